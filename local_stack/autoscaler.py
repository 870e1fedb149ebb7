"""What the Ray autoscaler and KubeRay do to the GPU pods, for `make local` with
`min_replicas: 0`: a simulated pod (its Ray node advertising one `triton` resource, then its
own Triton) started for each replica Serve wants beyond the pods there are, one at a time, up to
TRITONS; a pod that has held no replica for the idle timeout (POD_IDLE_S, by default
base/rayservice.yaml's `idleTimeoutSeconds`) stopped while there are more pods than Serve wants,
as the autoscaler removes an idle worker and KubeRay deletes its pod."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

Pod = TypeVar("Pod", bound=Hashable)


def idle_pods(created: Mapping[Pod, float], holding: set[Pod], wanted: int, idle_s: float,
              idle_since: dict[Pod, float], now: float) -> list[Pod]:
    """The Ray autoscaler's removal rule, shared by `make local` (PodOwner) and `make cluster`
    (local_stack/cluster/stack.py): a pod (created at `created[pod]`) that has held no replica
    for `idle_s` goes, one after another while more pods run than Serve wants. `idle_since`
    carries when each pod was last seen idle from one call to the next."""
    remaining = len(created)
    gone: list[Pod] = []
    for pod, at in created.items():
        if pod in holding or now - at < idle_s:
            idle_since.pop(pod, None)
            continue
        since = idle_since.setdefault(pod, now)
        if now - since >= idle_s and remaining > wanted:
            idle_since.pop(pod, None)
            gone.append(pod)
            remaining -= 1
    return gone


@dataclass
class PodOwner:
    """Decides, each `step`, which simulated pod starts or stops; the stack does the starting
    and stopping. `wanted` is Serve's target replica count (None while Serve does not say),
    `holding` the pods where Serve runs a replica now; `start_pod` returns once the pod's Ray
    node runs (SystemExit when it never does) with what waits for that node's exit: the thread
    that started it waits there, as the kernel stops a child whose forking thread ends
    (local_stack/processes.py sets PR_SET_PDEATHSIG). `stop_pod` returns once the pod's
    processes are gone."""

    slots: int
    idle_s: float
    wanted: Callable[[], int | None]
    holding: Callable[[], set[int]]
    start_pod: Callable[[int], Callable[[], object]]
    stop_pod: Callable[[int], None]
    say: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    # pod -> when it was asked for; what is starting or stopping now.
    started: dict[int, float] = field(default_factory=dict)
    starting: set[int] = field(default_factory=set)
    stopping: set[int] = field(default_factory=set)
    _idle_since: dict[int, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def step(self) -> None:
        target = self.wanted()
        if target is None:
            return
        wanted = min(target, self.slots)
        holding = self.holding()
        now = self.clock()
        with self._lock:
            free = sorted(set(range(self.slots)) - set(self.started) - self.stopping)
            # One pod starting at a time: a Ray node must register within 30 s, which two cores
            # cannot give several beside Tritons loading (as make cluster does it).
            if len(self.started) < wanted and not self.starting and free:
                pod = free[0]
                self.started[pod] = now
                self.starting.add(pod)
                self.say(f"autoscaler: Serve wants {target} replica(s), {len(self.started) - 1} "
                         f"GPU pod(s) run: starting pod {pod}")
                self._run(f"starting pod {pod}", self._start, pod)
            # A pod still starting counts among those running, never as idle.
            for pod in idle_pods(self.started, holding | self.starting, wanted, self.idle_s,
                                 self._idle_since, now):
                self.say(f"autoscaler: pod {pod} held no replica for {self.idle_s:.0f}s; "
                         "removing it")
                del self.started[pod]
                self.stopping.add(pod)
                self._run(f"stopping pod {pod}", self._stop, pod)

    def _start(self, pod: int) -> None:
        try:
            wait = self.start_pod(pod)
        except SystemExit as error:
            self.say(f"autoscaler: pod {pod} did not start ({error}); it is asked for again")
            with self._lock:
                self.started.pop(pod, None)
            return
        finally:
            with self._lock:
                self.starting.discard(pod)
        wait()

    def _stop(self, pod: int) -> None:
        try:
            self.stop_pod(pod)
            self.say(f"autoscaler: pod {pod} removed")
        finally:
            with self._lock:
                self.stopping.discard(pod)

    def _run(self, name: str, target: Callable[[int], None], pod: int) -> None:
        threading.Thread(target=target, args=(pod,), name=name, daemon=True).start()

    def busy(self) -> bool:
        """Whether a pod is starting or stopping now."""
        with self._lock:
            return bool(self.starting or self.stopping)
