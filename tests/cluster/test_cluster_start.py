"""The cluster as it starts: at its ready line every gateway pod answers (each Envoy learns
the Tritons from the DNS on its own clock, and the Service IP may send a client's first
connection to any of them); every pod's raylet has a /tmp/ray of its own, so nodes that
start together never race for one socket or log name (raylets that lost that race aborted
on bind(), a crash no cluster has); every GPU pod is listed a second time, at priority 1, for
the sequences of a pod out of the ready ones, and is unhealthy there while its Triton holds no
live sequence."""

from __future__ import annotations

import urllib.request

import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from local_stack.polling import until
from tests.cluster.conftest import TRITONS
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


def test_every_gpu_pod_is_listed_again_at_priority_1_apart_from_its_ready_copy(
        cluster: Cluster) -> None:
    """Envoy's STRICT_DNS keeps each DNS name's hosts apart: a ready pod is a healthy host at
    priority 0 (triton-pods) and a host of its own at priority 1 (triton-all-pods), checked on
    its replica's holding ports, which answer unhealthy while its Triton holds no live
    sequence (serve/triton_pod/holding.py). All of the cluster's GPU pods, not those ready at
    the moment asked (a pod whose Ray worker restarts is out a while)."""
    pods = cluster.settled(TRITONS)
    ips = {cluster.pod_ip(p) for p in pods}

    def listed_twice() -> object:
        for gateway in cluster.ready_pods("gateway"):
            for name in ("triton", "triton-http"):
                ready = cluster.envoy_hosts(gateway, name, 0)
                every = cluster.envoy_hosts(gateway, name, 1)
                if {ip for ip, flags in ready.items() if not flags} != ips or set(every) != ips \
                        or any("failed_active_health_check" not in f for f in every.values()):
                    return f"{gateway} {name}: ready {ready}, every pod {every}"
        return True

    until("each gateway to list every GPU pod at both priorities", listed_twice, 60)


def test_no_raylet_fails_to_bind_while_the_cluster_starts(cluster: Cluster) -> None:
    workdir = cluster.pods_dir.parent
    logs = sorted(workdir.glob("ray-*/session_*/logs/raylet*.out"))
    assert logs, f"no raylet log under {workdir}"
    failed = [f"{log.relative_to(workdir)}: {line[:200]}" for log in logs
              for line in log.read_text(errors="replace").splitlines() if BIND_FAILED in line]
    assert failed == [], failed
