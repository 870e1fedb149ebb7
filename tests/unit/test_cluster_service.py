"""The local kube-proxy (local_stack/cluster/service.py) rewrites its rules only when a
Service's endpoints change: the cluster's loop asks it five times a second, and an
iptables-restore each time starved the pods it stands beside (make test on 2026-12-03: 4,760
rewrites of unchanged endpoints, the same two gateway pods listed in another order)."""

from __future__ import annotations

import pytest

from local_stack.cluster import service
from local_stack.cluster.service import ServiceIp


@pytest.fixture
def rewrites(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    written: list[str] = []
    monkeypatch.setattr(service, "_restore", written.append)
    return written


def test_the_same_endpoints_in_another_order_write_no_rules(rewrites: list[str]) -> None:
    svc = ServiceIp("10.213.1.10", {8001: 8001})
    assert svc.set_endpoints(["10.213.0.9", "10.213.0.10"]) is True
    assert svc.set_endpoints(["10.213.0.9", "10.213.0.10"]) is False
    assert svc.set_endpoints(["10.213.0.10", "10.213.0.9"]) is False
    assert len(rewrites) == 1, f"unchanged endpoints rewrote the rules: {rewrites}"
    assert svc.endpoints == ["10.213.0.10", "10.213.0.9"]


def test_a_change_writes_the_rules_and_no_endpoints_reject(rewrites: list[str]) -> None:
    svc = ServiceIp("10.213.1.10", {8001: 8001})
    # The first write is never skipped: it puts the "has no endpoints" rule in place.
    assert svc.set_endpoints([]) is True
    assert "REJECT" in rewrites[-1] and "DNAT" not in rewrites[-1]
    assert svc.set_endpoints(["10.213.0.9"]) is True
    assert "--to-destination 10.213.0.9:8001" in rewrites[-1] and "REJECT" not in rewrites[-1]
    assert svc.set_endpoints([]) is True
    assert len(rewrites) == 3
