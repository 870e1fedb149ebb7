"""The cluster as it starts: at its ready line every gateway pod answers (each Envoy learns
the Tritons from the DNS on its own clock, and the Service IP may send a client's first
connection to any of them); every pod's raylet has a /tmp/ray of its own, so nodes that
start together never race for one socket or log name (raylets that lost that race aborted
on bind(), a crash no cluster has)."""

from __future__ import annotations

import urllib.request

import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from tests.support.cluster import Cluster

BIND_FAILED = "bind: Address already in use"


def test_every_gateway_pod_answers_at_the_ready_line(cluster: Cluster) -> None:
    """First in this folder: it runs as the ready line is printed (the fixture's own wait for
    the second gateway pod in the clients' Service aside)."""
    answers = {}
    for pod in cluster.ready_pods("gateway"):
        ip = cluster.pod_ip(pod)
        client = tc.InferenceServerClient(f"{ip}:8001")
        try:
            grpc_ready: object = client.is_server_ready()
        except InferenceServerException as error:
            grpc_ready = error
        finally:
            client.close()
        try:
            with urllib.request.urlopen(f"http://{ip}:8000/v2/health/ready", timeout=10) as r:
                http_ready: object = r.status
        except OSError as error:
            http_ready = error
        answers[pod] = (grpc_ready, http_ready)
    assert len(answers) == 2 and all(a == (True, 200) for a in answers.values()), answers


def test_no_raylet_fails_to_bind_while_the_cluster_starts(cluster: Cluster) -> None:
    workdir = cluster.pods_dir.parent
    logs = sorted(workdir.glob("ray-*/session_*/logs/raylet*.out"))
    assert logs, f"no raylet log under {workdir}"
    failed = [f"{log.relative_to(workdir)}: {line[:200]}" for log in logs
              for line in log.read_text(errors="replace").splitlines() if BIND_FAILED in line]
    assert failed == [], failed
