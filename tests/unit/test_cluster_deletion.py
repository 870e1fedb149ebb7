"""The local KubeRay (local_stack/cluster/stack.py) makes no GPU pod for a RayCluster being
deleted, however the autoscaler's pass and the deletion interleave: a pod the autoscaler started
while an upgrade deleted the old cluster joined that cluster's dying head and outlived it
(tests/cluster/test_upgrade.py on 2026-12-03: triton-6, in the old cluster, ready after the
upgrade was done). Kubernetes' garbage collector deletes every pod a deleted RayCluster owns,
and KubeRay creates none for a cluster with a deletionTimestamp."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from local_stack.cluster import stack as cluster_stack
from local_stack.cluster.stack import ClusterStack, RayCluster


class _Network:
    def __init__(self, during_add: Any) -> None:
        self.during_add = during_add
        self.pods: list[str] = []

    def add_pod(self, name: str, resolv_conf: str, etc: object = None) -> SimpleNamespace:
        self.pods.append(name)
        self.during_add()
        return SimpleNamespace(ip=f"10.213.0.{len(self.pods) + 10}", namespace=f"ns-{name}",
                               exec_prefix=lambda: [])

    def remove_pod(self, name: str) -> None:
        self.pods.remove(name)


STARTED: list[str] = []


class _Pod:
    def __init__(self, name: str, net: SimpleNamespace, containers: object, grace_s: float,
                 workdir: Path, *args: object) -> None:
        self.name, self.network, self.terminating = name, net, False
        self.dir = workdir / "pods" / name

    def start(self) -> None:
        STARTED.append(self.name)


def _stack(tmp_path: Path, net: _Network) -> ClusterStack:
    """The parts of a ClusterStack that make a pod, with its network and pods stood in."""
    STARTED.clear()
    s = ClusterStack.__new__(ClusterStack)
    s.workdir = tmp_path
    s.pods, s._labels, s._pod_cluster = {}, {}, {}
    s._counters = {"triton": 0, "gateway": 0}
    s._lock = threading.RLock()
    s.built = SimpleNamespace(labels={"worker": {}, "gateway": {}}, namespace="sonic",
                              worker=SimpleNamespace(grace_s=1.0))  # type: ignore[assignment]
    s.network = net  # type: ignore[assignment]
    s._triton_containers = lambda name, ip, cluster: []  # type: ignore[method-assign]
    return s


def _cluster() -> RayCluster:
    return RayCluster("triton-old", SimpleNamespace(name="ray-head"),  # type: ignore[arg-type]
                      "http://dashboard", "token", None, {})


def test_a_pod_started_as_its_cluster_is_deleted_is_not_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_stack, "Pod", _Pod)
    old = _cluster()
    # The deletion comes while the autoscaler's pass is making the pod (its namespace first).
    net = _Network(lambda: None)
    s = _stack(tmp_path, net)
    net.during_add = lambda: s.begin_deletion(old)
    made = s._new_pod("triton", old)
    assert made is None and s.pods == {} and STARTED == [], \
        f"a pod was made for cluster {old.name} while it was deleted: {s.pods}"
    assert net.pods == [], f"the pod's network namespace was left: {net.pods}"


def test_the_deletion_takes_every_pod_made_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_stack, "Pod", _Pod)
    old = _cluster()
    s = _stack(tmp_path, _Network(lambda: None))
    made = [s._new_pod("triton", old) for _ in range(2)]
    assert [p.name for p in made if p] == STARTED == ["triton-0", "triton-1"]
    assert [p.name for p in s.begin_deletion(old)] == ["triton-0", "triton-1", "ray-head"]
    assert s._new_pod("triton", old) is None
