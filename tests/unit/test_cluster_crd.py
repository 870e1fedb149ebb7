"""`make check-cluster-crd CRD=<file>`: a site checks the overlays against the RayService CRD
its cluster has installed. KubeRay v1.7.0's passes; a CRD from before worker groups had
`resources` (KubeRay < 1.5) fails loudly, naming the field the cluster would drop."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from schema.yaml_io import YAML_DUMPER, YAML_LOADER
from tests.support.kustomize import OVERLAYS, ROOT, build

V1_7_0 = ROOT / "schema" / "crd" / "ray.io_rayservices.yaml"


def _check(crd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "check-cluster-crd", f"CRD={crd}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_crd_we_test_against_passes() -> None:
    from schema.check import DEFAULT_KUBERNETES_VERSION, check_stream
    from schema.crd_to_jsonschema import generate

    schema = generate(str(V1_7_0), "v1")
    for overlay in OVERLAYS:
        problems, _ = check_stream(build(overlay), DEFAULT_KUBERNETES_VERSION, schema)
        assert problems == [], overlay


def test_a_crd_without_worker_group_resources_fails_naming_the_field(tmp_path: Path) -> None:
    crd = yaml.load(V1_7_0.read_text(), Loader=YAML_LOADER)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    groups = v1["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "rayClusterConfig"]["properties"]["workerGroupSpecs"]["items"]["properties"]
    del groups["resources"]
    old = tmp_path / "old-crd.yaml"
    old.write_text(yaml.dump(crd, Dumper=YAML_DUMPER))
    result = _check(old)
    assert result.returncode != 0
    assert "spec.rayClusterConfig.workerGroupSpecs[0]" in result.stdout
    assert "'resources' was unexpected" in result.stdout
    assert "KubeRay >= 1.5" in result.stdout


def test_make_check_cluster_crd_wants_a_file() -> None:
    result = subprocess.run(["make", "--no-print-directory", "check-cluster-crd"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage: make check-cluster-crd CRD=" in result.stdout


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
