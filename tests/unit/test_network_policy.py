"""components/network-policy, read with NetworkPolicy's own semantics (tests/support/network_policy.py,
itself first checked against the Kubernetes documentation's examples): Triton's ports reachable
only from its own pod, the gateway (gRPC) and monitoring (metrics); the clients' ports from
client namespaces; the KubeRay operator reaches the head; Ray's ports only inside the cluster."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.kustomize import ROOT, build, objects
from tests.support.network_policy import Pod, allowed

# --- the evaluator, on the examples of kubernetes.io/docs/concepts/services-networking/network-policies

DOCS_EXAMPLE = {
    "metadata": {"name": "test-network-policy", "namespace": "default"},
    "spec": {
        "podSelector": {"matchLabels": {"role": "db"}},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": [
            {"ipBlock": {"cidr": "172.17.0.0/16", "except": ["172.17.1.0/24"]}},
            {"namespaceSelector": {"matchLabels": {"project": "myproject"}}},
            {"podSelector": {"matchLabels": {"role": "frontend"}}},
        ], "ports": [{"protocol": "TCP", "port": 6379}]}],
    },
}
DB = Pod("default", {"role": "db"})


def test_docs_example_allows_each_listed_peer_on_the_port() -> None:
    policies = [DOCS_EXAMPLE]
    assert allowed(policies, DB, Pod("default", {"role": "frontend"}), 6379)
    assert allowed(policies, DB, Pod("other", {}, {"project": "myproject"}), 6379)
    assert allowed(policies, DB, Pod("x", {}, ip="172.17.2.3"), 6379)
    assert not allowed(policies, DB, Pod("x", {}, ip="172.17.1.3"), 6379)  # except
    assert not allowed(policies, DB, Pod("other", {"role": "frontend"}), 6379)  # other ns
    assert not allowed(policies, DB, Pod("default", {"role": "frontend"}), 6380)
    assert allowed(policies, Pod("default", {"role": "web"}), Pod("x", {}), 80)  # not selected


def test_docs_default_deny_and_allow_all() -> None:
    deny = {"metadata": {"name": "default-deny-ingress"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    allow = {"metadata": {"name": "allow-all-ingress"},
             "spec": {"podSelector": {}, "ingress": [{}], "policyTypes": ["Ingress"]}}
    anyone = Pod("elsewhere", {"app": "x"})
    assert not allowed([deny], DB, anyone, 5432)
    assert allowed([deny, allow], DB, anyone, 5432)


def test_docs_namespace_and_pod_selector_in_one_peer_mean_both() -> None:
    both = {"metadata": {"name": "and"}, "spec": {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"user": "alice"}},
         "podSelector": {"matchLabels": {"role": "client"}}}]}]}}
    either = {"metadata": {"name": "or"}, "spec": {"podSelector": {}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"user": "alice"}}},
        {"podSelector": {"matchLabels": {"role": "client"}}}]}]}}
    alice_other = Pod("a", {"role": "server"}, {"user": "alice"})
    local_client = Pod("default", {"role": "client"})
    assert not allowed([both], DB, alice_other, 1)
    assert allowed([either], DB, alice_other, 1)
    assert allowed([either], DB, local_client, 1)
    assert allowed([both], DB, Pod("a", {"role": "client"}, {"user": "alice"}), 1)


def test_docs_port_range_and_match_expressions() -> None:
    ranged = {"metadata": {"name": "multi-port-egress"}, "spec": {
        "podSelector": {"matchExpressions": [{"key": "role", "operator": "In",
                                              "values": ["db", "cache"]}]},
        "ingress": [{"ports": [{"protocol": "TCP", "port": 32000, "endPort": 32768}]}]}}
    anyone = Pod("elsewhere", {})
    assert allowed([ranged], DB, anyone, 32768)
    assert not allowed([ranged], DB, anyone, 32769)
    assert not allowed([ranged], DB, anyone, 32000, protocol="UDP")
    assert allowed([ranged], Pod("default", {"role": "web"}), anyone, 1)  # not selected


# --- our policies

NAMESPACE = "components-test"
BASE = {"app.kubernetes.io/name": "sonic-ray"}
WORKER = Pod(NAMESPACE, {**BASE, "app.kubernetes.io/component": "triton-worker"})
HEAD = Pod(NAMESPACE, {**BASE, "app.kubernetes.io/component": "ray-head"})
GATEWAY = Pod(NAMESPACE, {**BASE, "app.kubernetes.io/component": "gateway"})
OTHER_POD = Pod(NAMESPACE, {"app": "notebook"})
CLIENT = Pod("cms-users", {}, {"sonic-ray.io/client": "true"})
MONITORING = Pod("monitoring", {})
OPERATOR = Pod("ray-system", {"app.kubernetes.io/name": "kuberay-operator"})
STRANGER = Pod("elsewhere", {})


@pytest.fixture(scope="module")
def policies() -> list[dict[str, Any]]:
    built = build(ROOT / "tests" / "fixtures" / "components" / "all-optional")
    return [o for o in objects(built) if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("port", [8001, 8100])
@pytest.mark.parametrize("source", [HEAD, OTHER_POD, CLIENT, MONITORING, STRANGER, OPERATOR],
                         ids=["ray-head", "other-pod", "client", "monitoring", "stranger", "operator"])
def test_triton_ports_are_closed_outside_the_pod(
    policies: list[dict[str, Any]], source: Pod, port: int
) -> None:
    assert not allowed(policies, WORKER, source, port)


def test_tritons_grpc_and_http_ports_are_open_to_the_gateway_only(
    policies: list[dict[str, Any]],
) -> None:
    assert allowed(policies, WORKER, GATEWAY, 8001)
    assert allowed(policies, WORKER, GATEWAY, 8100)
    assert not allowed(policies, WORKER, GATEWAY, 8002)  # metrics are monitoring's
    assert not allowed(policies, WORKER, WORKER, 8001)  # another worker pod
    assert not allowed(policies, WORKER, WORKER, 8100)


def test_triton_metrics_only_from_monitoring(policies: list[dict[str, Any]]) -> None:
    assert allowed(policies, WORKER, MONITORING, 8002)
    assert not any(allowed(policies, WORKER, s, 8002) for s in (HEAD, CLIENT, STRANGER))


def test_clients_reach_the_gateway_and_the_serve_proxy(policies: list[dict[str, Any]]) -> None:
    for gateway_port, serve_port in ((8001, 9000), (8000, 8000)):  # gRPC, HTTP
        assert allowed(policies, GATEWAY, CLIENT, gateway_port)
        assert allowed(policies, HEAD, CLIENT, serve_port)
        for stranger in (STRANGER, OTHER_POD):
            assert not allowed(policies, GATEWAY, stranger, gateway_port)
            assert not allowed(policies, HEAD, stranger, serve_port)
    assert allowed(policies, GATEWAY, MONITORING, 9902)
    assert not allowed(policies, GATEWAY, STRANGER, 9902)


def test_the_kuberay_operator_reaches_the_head(policies: list[dict[str, Any]]) -> None:
    assert allowed(policies, HEAD, OPERATOR, 8265)  # Serve config pushed to the dashboard
    assert allowed(policies, HEAD, OPERATOR, 8000)  # the Serve proxy's health probe
    assert not allowed(policies, HEAD, OPERATOR, 10001)
    assert not allowed(policies, HEAD, STRANGER, 8265)


@pytest.mark.parametrize("port", [6379, 8265, 10001, 52365, 8000, 9000, 12345, 40000])
def test_ray_ports_only_inside_the_ray_cluster(policies: list[dict[str, Any]], port: int) -> None:
    assert allowed(policies, HEAD, WORKER, port)
    if port not in (9000, 8000):  # Serve's gRPC and HTTP proxies: the Serve path's clients
        assert not allowed(policies, HEAD, CLIENT, port)
    assert not allowed(policies, HEAD, STRANGER, port)
    assert not allowed(policies, HEAD, OTHER_POD, port)


def test_ray_metrics_from_monitoring(policies: list[dict[str, Any]]) -> None:
    assert allowed(policies, WORKER, MONITORING, 8080)
    assert not allowed(policies, WORKER, STRANGER, 8080)


def test_token_auth_component_reaches_every_ray_container_and_the_gateway() -> None:
    built = objects(build(ROOT / "tests" / "fixtures" / "components" / "all-optional"))
    (service,) = [o for o in built if o["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    (gateway,) = [o for o in built if o["kind"] == "Deployment"]
    tokens = {"name": "SONIC_RAY_AUTH_TOKENS_FILE", "value": "/etc/sonic-ray/client-tokens/tokens"}
    for pod in [cluster["headGroupSpec"]["template"]["spec"],
                *(g["template"]["spec"] for g in cluster["workerGroupSpecs"]),
                gateway["spec"]["template"]["spec"]]:
        first = pod["containers"][0]
        assert tokens in first["env"]
        assert {"name": "client-tokens", "secret": {"secretName": "triton-client-tokens"}} in pod["volumes"]


# Every test here reads kustomize builds (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
