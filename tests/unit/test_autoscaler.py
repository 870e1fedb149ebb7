"""The local stack's autoscaler (local_stack/autoscaler.py) deciding alone, with a fake clock and
pods that start and stop at once: one pod starting at a time, never more than the slots, an idle
pod going only after the idle time and only while more run than Serve wants, a pod whose start
failed asked for again."""

from __future__ import annotations

import threading
from collections.abc import Callable

from local_stack.autoscaler import PodOwner, idle_pods
from local_stack.polling import until


class Pods:
    def __init__(self) -> None:
        self.wanted: int | None = 0
        self.holding: set[int] = set()
        self.now = 0.0
        self.fail_next_start = False
        self.release = threading.Event()
        # A Ray node registering: start_pod returns once this is set.
        self.registered = threading.Event()
        self.registered.set()
        self.started: list[int] = []
        self.stopped: list[int] = []
        self.said: list[str] = []

    def start(self, pod: int) -> Callable[[], object]:
        if self.fail_next_start:
            self.fail_next_start = False
            raise SystemExit(f"pod {pod}'s Ray node never started")
        self.started.append(pod)
        self.registered.wait(5)
        return self.release.wait

    def owner(self, slots: int = 2, idle_s: float = 10) -> PodOwner:
        return PodOwner(slots=slots, idle_s=idle_s, wanted=lambda: self.wanted,
                        holding=lambda: set(self.holding), start_pod=self.start,
                        stop_pod=self.stopped.append, say=self.said.append,
                        clock=lambda: self.now)


def settled(owner: PodOwner) -> None:
    until("the autoscaler's pod to start or stop", lambda: not owner.busy() or "busy", 5,
          every_s=0.01)


def test_pods_start_one_at_a_time_up_to_the_slots() -> None:
    pods = Pods()
    owner = pods.owner(slots=2)
    owner.step()
    assert pods.started == []
    pods.wanted = 5
    pods.registered.clear()
    owner.step()
    owner.step()
    assert pods.started == [0], "a second pod started while the first was starting"
    pods.registered.set()
    settled(owner)
    owner.step()
    settled(owner)
    owner.step()
    settled(owner)
    assert pods.started == [0, 1], pods.said
    assert set(owner.started) == {0, 1}


def test_an_idle_pod_goes_after_the_idle_time_only_while_more_run_than_wanted() -> None:
    pods = Pods()
    owner = pods.owner(slots=2, idle_s=10)
    pods.wanted = 2
    for _ in range(2):
        owner.step()
        settled(owner)
    pods.holding = {0, 1}
    pods.now = 30
    owner.step()
    assert pods.stopped == [], "a pod holding a replica was removed"
    pods.holding = {1}
    owner.step()  # pod 0 idle from now
    pods.now = 38
    owner.step()
    assert pods.stopped == [], "removed before the idle time"
    pods.now = 45
    owner.step()
    assert pods.stopped == [], "an idle pod removed while Serve still wants two"
    pods.wanted = 1
    owner.step()
    settled(owner)
    assert pods.stopped == [0] and set(owner.started) == {1}
    pods.wanted = None  # Serve does not answer: nothing changes
    pods.holding = set()
    pods.now = 200
    owner.step()
    settled(owner)
    assert pods.stopped == [0]


def test_a_pod_that_did_not_start_is_asked_for_again() -> None:
    pods = Pods()
    owner = pods.owner(slots=1)
    pods.wanted = 1
    pods.fail_next_start = True
    owner.step()
    settled(owner)
    assert owner.started == {} and any("did not start" in s for s in pods.said), pods.said
    owner.step()
    settled(owner)
    assert pods.started == [0]
    pods.release.set()


def test_the_removal_rule_counts_down_as_it_removes() -> None:
    # make cluster's pods by name: three idle past the time, Serve wants one: two go, the
    # one holding a replica stays, and a pod created within the idle time is never idle.
    created = {"triton-0": 0.0, "triton-1": 0.0, "triton-2": 0.0, "triton-3": 95.0}
    since: dict[str, float] = {}
    assert idle_pods(created, {"triton-1"}, 1, 10, since, 90.0) == []
    gone = idle_pods(created, {"triton-1"}, 1, 10, since, 100.0)
    assert gone == ["triton-0", "triton-2"], gone
    assert since == {}, "a removed pod's idle time was kept"
    # Serve wants every pod there is: none goes, however long idle.
    assert idle_pods(created, set(), 4, 10, {"triton-0": 0.0}, 200.0) == []
