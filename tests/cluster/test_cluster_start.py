"""The Ray nodes as on a cluster: every pod's raylet has a /tmp/ray of its own, so nodes that
start together never race for one socket or log name (raylets that lost that race aborted
on bind(), a crash no cluster has)."""

from __future__ import annotations

from tests.support.cluster import Cluster

BIND_FAILED = "bind: Address already in use"


def test_no_raylet_fails_to_bind_while_the_cluster_starts(cluster: Cluster) -> None:
    workdir = cluster.pods_dir.parent
    logs = sorted(workdir.glob("ray-*/session_*/logs/raylet*.out"))
    assert logs, f"no raylet log under {workdir}"
    failed = [f"{log.relative_to(workdir)}: {line[:200]}" for log in logs
              for line in log.read_text(errors="replace").splitlines() if BIND_FAILED in line]
    assert failed == [], failed
