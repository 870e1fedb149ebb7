"""What `make cluster` reads from the built overlays/local, and its upgrade control file."""

from __future__ import annotations

import pytest

from local_stack.cluster import manifests
from local_stack.cluster.stack import upgrade_settings


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
