"""components/network-policy, read with NetworkPolicy's own semantics: Triton's ports reachable
from nowhere outside its pod, Serve's client port from client namespaces, metrics from the
monitoring namespace, Ray's ports only from the Ray cluster's pods."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from tests.kustomize import ROOT, build

RAY_POD = {"app.kubernetes.io/name": "sonic-ray", "app.kubernetes.io/component": "triton-worker"}
NAMESPACE = "components-test"


@dataclass
class Source:
    namespace: str
    namespace_labels: dict[str, str]
    pod_labels: dict[str, str] = field(default_factory=dict)


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_matches(peer: dict[str, Any], source: Source) -> bool:
    if "ipBlock" in peer:
        return False  # the sources here are pods
    pods_ok = "podSelector" not in peer or _matches(peer["podSelector"], source.pod_labels)
    if "namespaceSelector" in peer:
        ns_ok = _matches(peer["namespaceSelector"], source.namespace_labels)
    else:
        ns_ok = source.namespace == NAMESPACE
    return pods_ok and ns_ok and ("podSelector" in peer or "namespaceSelector" in peer)


def _port_matches(rule_port: dict[str, Any], port: int) -> bool:
    start = int(rule_port["port"])
    return start <= port <= int(rule_port.get("endPort", start))


def reachable(policies: list[dict[str, Any]], source: Source, port: int) -> bool:
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], RAY_POD)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    return any(
        any(_peer_matches(peer, source) for peer in rule.get("from", []))
        and any(_port_matches(p, port) for p in rule.get("ports", []))
        for policy in selecting for rule in policy["spec"].get("ingress", [])
    )


@pytest.fixture(scope="module")
def policies() -> list[dict[str, Any]]:
    built = build(ROOT / "tests" / "fixtures" / "components" / "all-optional")
    return [o for o in yaml.safe_load_all(built) if o and o["kind"] == "NetworkPolicy"]


RAY_PEER = Source(NAMESPACE, {"kubernetes.io/metadata.name": NAMESPACE}, RAY_POD)
OTHER_POD = Source(NAMESPACE, {"kubernetes.io/metadata.name": NAMESPACE}, {"app": "notebook"})
CLIENT = Source("cms-users", {"kubernetes.io/metadata.name": "cms-users", "sonic-ray.io/client": "true"})
MONITORING = Source("monitoring", {"kubernetes.io/metadata.name": "monitoring"})
STRANGER = Source("elsewhere", {"kubernetes.io/metadata.name": "elsewhere"})


@pytest.mark.parametrize("port", [8001, 8100])
@pytest.mark.parametrize("source", [RAY_PEER, OTHER_POD, CLIENT, MONITORING, STRANGER],
                         ids=["ray-pod", "other-pod", "client", "monitoring", "stranger"])
def test_triton_ports_are_closed_outside_the_pod(
    policies: list[dict[str, Any]], source: Source, port: int
) -> None:
    assert not reachable(policies, source, port)


def test_triton_metrics_only_from_monitoring(policies: list[dict[str, Any]]) -> None:
    assert reachable(policies, MONITORING, 8002)
    assert not any(reachable(policies, s, 8002) for s in (RAY_PEER, CLIENT, STRANGER))


def test_serve_client_port_from_client_namespaces(policies: list[dict[str, Any]]) -> None:
    assert reachable(policies, CLIENT, 9000)
    assert not reachable(policies, STRANGER, 9000)
    assert not reachable(policies, OTHER_POD, 9000)


@pytest.mark.parametrize("port", [6379, 8265, 10001, 52365, 8000, 9000, 12345, 40000])
def test_ray_ports_only_inside_the_ray_cluster(policies: list[dict[str, Any]], port: int) -> None:
    assert reachable(policies, RAY_PEER, port)
    if port != 9000:
        assert not reachable(policies, CLIENT, port)
    assert not reachable(policies, STRANGER, port)
    assert not reachable(policies, OTHER_POD, port)


def test_ray_metrics_from_monitoring(policies: list[dict[str, Any]]) -> None:
    assert reachable(policies, MONITORING, 8080)
    assert not reachable(policies, STRANGER, 8080)


def test_token_auth_component_reaches_every_ray_container() -> None:
    built = [o for o in yaml.safe_load_all(
        build(ROOT / "tests" / "fixtures" / "components" / "all-optional")) if o]
    (service,) = [o for o in built if o["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        ray = pod["containers"][0]
        assert {"name": "SONIC_RAY_AUTH_TOKENS_FILE",
                "value": "/etc/sonic-ray/client-tokens/tokens"} in ray["env"]
        assert {"name": "client-tokens", "secret": {"secretName": "triton-client-tokens"}} in pod["volumes"]
