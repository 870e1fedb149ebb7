"""clusters/<site>: Flux objects in the site's own namespace, deploying its overlay; generated
ConfigMaps kept from pruning; and the RayService health expressions evaluated with a real CEL
evaluator (cel-python) on recorded RayService statuses, in the order Flux's kustomize-controller
applies them (fluxcd/pkg runtime/cel StatusEvaluator: observedGeneration, inProgress, failed,
current; none true means in progress)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import celpy.adapter
import pytest
import yaml

from tests.support.kustomize import ROOT, build, objects

# Each site's folder, built as Flux (or kubectl apply -k) would build it.
FLUX = sorted(p.parent for p in (ROOT / "clusters").glob("*/overlay-path.yaml"))
SITE_NAMESPACES = {"purdue-af": "cms", "nautilus": "cms-sonic"}
# The ConfigMaps built without a hash suffix, replaced in place on a change.
FIXED_NAME_CONFIGMAPS = {g["name"] for g in yaml.safe_load(
    (ROOT / "observability" / "kustomization.yaml").read_text())["configMapGenerator"]}


@pytest.mark.parametrize("flux", FLUX, ids=[f.name for f in FLUX])
def test_flux_objects_live_in_the_sites_namespace_and_deploy_its_overlay(flux: Path) -> None:
    docs = {d["kind"]: d for d in objects(build(flux))}
    source, kustomization = docs["GitRepository"], docs["Kustomization"]
    site = flux.name
    assert {source["metadata"]["namespace"], kustomization["metadata"]["namespace"]} == {
        SITE_NAMESPACES[site]}
    spec = kustomization["spec"]
    assert spec["sourceRef"] == {"kind": "GitRepository", "name": source["metadata"]["name"]}
    assert spec["path"] == f"./overlays/{site}"
    # Every top-level directory the overlay builds from is fetched.
    for needed in ("base", "components", "gateway", "observability", "overlays", "serve"):
        assert f"!/{needed}/" in source["spec"]["ignore"]
    assert "dependsOn" not in spec or all("namespace" in d for d in spec["dependsOn"])
    assert spec["prune"] is True and spec["wait"] is True
    assert int(spec["timeout"].rstrip("m")) >= 20
    assert "postBuild" not in spec
    built = objects(build(ROOT / spec["path"]))
    (rayservice,) = [o for o in built if o["kind"] == "RayService"]
    assert rayservice["metadata"]["annotations"]["kustomize.toolkit.fluxcd.io/substitute"] == "disabled"
    # Hash-suffixed ConfigMaps stay while an old Ray cluster may mount them; the fixed-name
    # ones (the dashboard and the rule file) are replaced in place.
    generated = [o for o in built if o["kind"] == "ConfigMap"
                 and o["metadata"]["name"] not in FIXED_NAME_CONFIGMAPS]
    assert generated
    for o in generated:
        meta = o["metadata"]
        assert meta.get("labels", {}).get("sonic-ray.io/generated") == "true", meta["name"]
        assert meta.get("annotations", {}).get(
            "kustomize.toolkit.fluxcd.io/prune") == "disabled", meta["name"]


def flux_status(exprs: dict[str, str], obj: dict[str, Any]) -> str:
    """What kustomize-controller makes of an object with these health expressions."""
    status = obj.get("status") or {}
    if "observedGeneration" in status and status["observedGeneration"] != obj["metadata"].get(
            "generation", status["observedGeneration"]):
        return "InProgress"
    env = celpy.Environment()
    activation = {key: celpy.adapter.json_to_cel(value) for key, value in obj.items()}
    for name, result in (("inProgress", "InProgress"), ("failed", "Failed"),
                         ("current", "Current")):
        if name in exprs:
            value = env.program(env.compile(exprs[name])).evaluate(activation)
            assert isinstance(value, celpy.celtypes.BoolType), (name, value)
            if value:
                return result
    return "InProgress"


def _rayservice(conditions: list[dict[str, str]] | None, generation: int = 2,
                observed: int = 2) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "ray.io/v1", "kind": "RayService",
                           "metadata": {"name": "triton", "generation": generation}}
    if conditions is not None:
        obj["status"] = {"observedGeneration": observed, "conditions": conditions,
                         "serviceStatus": "Running"}
    return obj


def _ready(status: str, reason: str) -> dict[str, str]:
    return {"type": "Ready", "status": status, "reason": reason}


def _upgrade(status: str) -> dict[str, str]:
    return {"type": "UpgradeInProgress", "status": status,
            "reason": "BothActivePendingClustersExist" if status == "True" else "NoPendingCluster"}


# Statuses as KubeRay v1.7.0 writes them (ray-operator/apis/ray/v1/rayservice_types.go).
RECORDED = [
    ("just applied, no status yet", _rayservice(None), "InProgress"),
    ("status without conditions", {**_rayservice(None), "status": {}}, "InProgress"),
    ("initializing", _rayservice([_ready("False", "Initializing"), _upgrade("False")]),
     "InProgress"),
    ("serving", _rayservice([_ready("True", "NonZeroServeEndpoints"), _upgrade("False")]),
     "Current"),
    ("serving, new cluster coming up", _rayservice(
        [_ready("True", "NonZeroServeEndpoints"), _upgrade("True")]), "InProgress"),
    ("serving, spec change not yet seen", _rayservice(
        [_ready("True", "NonZeroServeEndpoints"), _upgrade("False")], generation=3, observed=2),
     "InProgress"),
    ("no endpoint left", _rayservice([_ready("False", "ZeroServeEndpoints"), _upgrade("False")]),
     "InProgress"),
    ("refused spec", _rayservice([_ready("False", "ValidationFailed")]), "Failed"),
    ("never became ready", _rayservice([_ready("False", "InitializingTimeout"), _upgrade("False")]),
     "Failed"),
]


@pytest.mark.parametrize("flux", FLUX, ids=[f.name for f in FLUX])
@pytest.mark.parametrize(("case", "obj", "expected"), RECORDED, ids=[c for c, _, _ in RECORDED])
def test_health_expressions_on_recorded_statuses(flux: Path, case: str, obj: dict[str, Any],
                                                 expected: str) -> None:
    kustomization = next(d for d in objects(build(flux)) if d["kind"] == "Kustomization")
    (exprs,) = kustomization["spec"]["healthCheckExprs"]
    assert exprs["kind"] == "RayService"
    assert flux_status(exprs, obj) == expected, case


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
