"""The front door's wiring that the API server accepts but nothing answers through (schema/
facts.py: services-select-pods, ingress-backends-resolve, gateway-disruption-budget,
gateway-grace-covers-drain), at the edges the fixtures in tests/fixtures/invariants/ do not
reach: a budget by maxUnavailable or a percentage, a default backend, a drain set in the env."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from schema.check import DEFAULT_KUBERNETES_VERSION, check_stream
from tests.support.kustomize import ROOT, build, objects, stream

# Each test builds the site with kubectl (tests/support/kustomize.py, built once a session).
pytestmark = pytest.mark.processes


def _built() -> list[dict[str, Any]]:
    return objects(build(ROOT / "overlays" / "nautilus"))


def _one(built: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in built if o["kind"] == kind]
    return found


def _envoy(built: list[dict[str, Any]]) -> dict[str, Any]:
    pod = _one(built, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "envoy")


def _problems(change: Callable[[list[dict[str, Any]]], object]) -> list[str]:
    built = copy.deepcopy(_built())
    change(built)
    return check_stream(stream(built), DEFAULT_KUBERNETES_VERSION)[0]


def test_the_site_as_built_passes() -> None:
    assert _problems(lambda built: None) == []


@pytest.mark.parametrize(("spec", "refused"), [
    ({"maxUnavailable": 1}, None),
    ({"maxUnavailable": "50%"}, None),  # a percentage: not held against a count
    ({"maxUnavailable": 0}, "keeps 2 of 2 gateway pods: a node drain waits forever"),
    ({"minAvailable": 0}, "keeps 0: a drain may take every gateway pod at once"),
])
def test_the_gateways_budget_keeps_one_pod_and_lets_one_go(spec: dict[str, Any],
                                                           refused: str | None) -> None:
    def change(built: list[dict[str, Any]]) -> None:
        budget = _one(built, "PodDisruptionBudget")["spec"]
        budget.pop("minAvailable")
        budget.update(spec)

    mine = [p for p in _problems(change) if p.startswith("gateway-disruption-budget: ")]
    assert mine == [] if refused is None else len(mine) == 1 and refused in mine[0], mine


def test_a_drain_made_longer_in_the_env_needs_a_longer_grace_period() -> None:
    problems = _problems(lambda built: _envoy(built).setdefault("env", []).append(
        {"name": "DRAIN_MAX_S", "value": "58"}))
    mine = [p for p in problems if p.startswith("gateway-grace-covers-drain: ")]
    assert len(mine) == 1 and "--drain-time-s minus DRAIN_MAX_S is -8" in mine[0] and \
        "DRAIN_MAX_S (58)" in mine[0], problems


def test_an_ingress_default_backend_naming_no_service_is_refused() -> None:
    problems = _problems(lambda built: [o["spec"].__setitem__("defaultBackend", {
        "service": {"name": "triton", "port": {"number": 8001}}})
        for o in built if o["kind"] == "Ingress" and o["metadata"]["name"] == "triton-http"])
    mine = [p for p in problems if p.startswith("ingress-backends-resolve: ")]
    assert len(mine) == 1 and "Ingress triton-http spec.defaultBackend" in mine[0] and \
        "Service 'triton', which the build does not have" in mine[0], problems


def test_a_fact_no_object_gives_is_said_by_its_rule_not_as_the_whole_object() -> None:
    problems = _problems(lambda built: built.remove(next(
        o for o in built if o["kind"] == "Service" and o["metadata"]["name"] == "triton-grpc")))
    mine = [p for p in problems if p.startswith("client-service-targets-the-data-path: ")]
    assert len(mine) == 1 and "RayService cms-sonic/triton (the build): nothing in it gives " \
        "targetPort minus" in mine[0], problems
    assert not [p for p in problems if "(whole object)" in p], problems


def test_a_service_selecting_the_labels_kuberay_adds_selects_the_ray_pods() -> None:
    """A site's Service for the Ray dashboard selects the head by KubeRay's labels, which no
    template carries; a misspelt selector beside it is still refused."""
    def change(built: list[dict[str, Any]]) -> None:
        for name, selector in (("ray-dashboard", {"ray.io/node-type": "head",
                                                  "app.kubernetes.io/name": "sonic-ray"}),
                               ("misspelt", {"app.kubernetes.io/name": "sonic-rey"})):
            built.append({"apiVersion": "v1", "kind": "Service",
                          "metadata": {"name": name, "namespace": "cms-sonic"},
                          "spec": {"selector": selector,
                                   "ports": [{"port": 8265, "targetPort": 8265}]}})

    mine = [p for p in _problems(change) if p.startswith("services-select-pods: ")]
    assert len(mine) == 1 and "Service misspelt spec.selector" in mine[0], mine
