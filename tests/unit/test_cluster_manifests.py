"""What `make cluster` reads from the built overlays/local, its settings, and its upgrade control
file."""

from __future__ import annotations

from pathlib import Path

import pytest

from local_stack.cluster import manifests
from local_stack.cluster.stack import ClusterSettings, upgrade_settings
from local_stack.harness import serve_config_with
from local_stack.settings import min_replicas


@pytest.fixture(scope="module")
def built() -> manifests.Built:
    return manifests.read(manifests.build())


def test_the_gateway_resolves_the_serve_service_kuberay_points_at_the_active_cluster(
        built: manifests.Built) -> None:
    # The name Envoy resolves is spec.serveService's, so the stack lists the active cluster's
    # workers under it (KubeRay's selector), and no Service of the build selects by labels.
    assert "triton-pods" in built.envoy_files["envoy.yaml"]
    assert built.serve_service == "triton-pods"
    assert "triton-pods" not in built.headless
    assert built.exclude_head is True
    assert built.deletion_delay_s == 60


def test_the_upgrade_file_takes_known_settings_and_names_the_bad_line() -> None:
    assert upgrade_settings("") == {}
    assert upgrade_settings("# new models\nMODEL_REPOSITORY=/m\n\nSERVE_CONFIG = /c.yaml\n") == {
        "MODEL_REPOSITORY": "/m", "SERVE_CONFIG": "/c.yaml"}
    with pytest.raises(SystemExit, match=r"line 2: 'TRITONS=4' .*MODEL_REPOSITORY, SERVE_CONFIG"):
        upgrade_settings("MODEL_REPOSITORY=/m\nTRITONS=4\n")
    with pytest.raises(SystemExit, match="line 1: 'models'"):
        upgrade_settings("models")


@pytest.mark.parametrize(("autoscaling", "env", "tritons"), [
    ({"min_replicas": 0, "max_replicas": 3}, {}, 0),   # scale to zero: no GPU pod at start
    ({"min_replicas": 2, "max_replicas": 3}, {}, 2),   # KubeRay starts what Serve keeps
    ({"min_replicas": 0, "max_replicas": 3}, {"TRITONS": "1"}, 1),  # said: as said
])
def test_gpu_pods_at_start_are_the_configs_min_replicas_unless_tritons_says(
        built: manifests.Built, tmp_path: Path, autoscaling: dict[str, int],
        env: dict[str, str], tritons: int) -> None:
    config = serve_config_with(tmp_path, autoscaling=autoscaling)
    settings = ClusterSettings.from_env(built, {"SERVE_CONFIG": str(config), **env})
    assert min_replicas(settings.serve_config) == autoscaling["min_replicas"]
    assert settings.tritons == tritons


def test_more_gpu_pods_at_start_than_the_group_may_have_is_refused(
        built: manifests.Built) -> None:
    with pytest.raises(SystemExit, match=f"TRITONS=9: between 0 and {built.worker_max_replicas}"):
        ClusterSettings.from_env(built, {"TRITONS": "9"})


# Every test here reads kustomize builds (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
