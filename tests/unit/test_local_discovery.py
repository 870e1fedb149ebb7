"""The local stack's discovery (local_stack/stack.py, `Discovery`), the stand-in for the
headless Service `triton-pods`: a dashboard that does not answer for a moment says nothing
about the replicas, so the pods listed stay listed (in the cluster a pod's readiness comes from
its node's Serve proxy, not from the dashboard), instead of every call failing until the next
answer (seen in CI: 261 calls UNAVAILABLE in test_gateway.py while the dashboard was slow)."""

from __future__ import annotations

import urllib.error
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from local_stack import ray_cluster
from local_stack.settings import TritonPorts
from local_stack.stack import Discovery


def _discovery(tmp_path: Path) -> Discovery:
    ports = {i: TritonPorts(8000 + 100 * i, 8001 + 100 * i, 8002 + 100 * i) for i in (0, 1)}
    settings = SimpleNamespace(tritons=2, ray_token="token", triton=ports.__getitem__,
                               pod_holding_ports=lambda i: (8004 + 100 * i, 8005 + 100 * i))
    stack: Any = SimpleNamespace(settings=settings, workdir=tmp_path, dashboard="http://ray")
    return Discovery(stack)


def test_a_dashboard_that_does_not_answer_keeps_the_pods_listed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    discovery = _discovery(tmp_path)
    answers: list[object] = [
        [{"state": "RUNNING", "pid": 10}, {"state": "RUNNING", "pid": 11}],
        urllib.error.URLError("timed out"),
        [{"state": "RUNNING", "pid": 10}, {"state": "STOPPING", "pid": 11}],
        [{"state": "RUNNING", "pid": 10}],
    ]

    def replicas(dashboard: str, token: str) -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ray_cluster, "replicas", replicas)
    monkeypatch.setattr(ray_cluster, "replica_triton_address",
                        lambda pid: f"localhost:{8001 + 100 * (pid - 10)}")
    try:
        assert discovery.replica_pods() == {0, 1}
        assert discovery.replica_pods() == {0, 1}, "a failed question emptied the pods"
        # A stopping replica's pod stays until its readiness says otherwise (pod.py _leave).
        assert discovery.replica_pods() == {0, 1}
        assert discovery.replica_pods() == {0}
    finally:
        discovery.stop()
