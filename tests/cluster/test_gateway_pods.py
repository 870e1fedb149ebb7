"""The gateway's pods replaced one at a time under load, as a rollout of a changed envoy.yaml
or a node drain replaces them: every call in flight on a stopping gateway pod finishes there,
every later call goes to the other one; not one call fails."""

from __future__ import annotations

import time

from tests.support.cluster import Cluster, under_load, until


def _roll_one(cluster: Cluster, pod: str) -> None:
    before = set(cluster.ready_pods("gateway"))
    mark = cluster.line_index()
    cluster.delete(pod)
    # The Deployment replaces it at once; the old pod drains until its preStop ends.
    until(f"a new gateway pod beside {pod} to be ready",
          lambda: len(set(cluster.ready_pods("gateway")) - before) == 1 or
          f"ready: {cluster.ready_pods('gateway')}", 120, every_s=0.5)
    cluster.wait_for(rf"\[cluster\] {pod}: gone$", 200, after=mark)


def test_gateway_rollout_under_load_fails_no_call(cluster: Cluster) -> None:
    cluster.settled(3)
    gateways = cluster.ready_pods("gateway")
    assert len(gateways) == 2, gateways
    started = time.monotonic()

    def roll() -> None:
        for pod in gateways:
            _roll_one(cluster, pod)

    calls = under_load(cluster, roll)
    print(f"rollout of {gateways} took {time.monotonic() - started:.0f}s; {calls.summary()}")
    assert calls.count("grpc") > 100 and calls.count("http") > 50 and calls.count("stream") > 20
    assert calls.failed() == [], calls.failed()[:20]
    assert not set(gateways) & set(cluster.ready_pods("gateway"))
