"""The one reader of the GPU pods' application in a Serve config (schema/serve_app.py)."""

from __future__ import annotations

from typing import Any

import pytest

from schema.serve_app import (
    NoTritonAppError,
    policy_kwargs,
    replica_bounds,
    triton_app,
    with_policy_kwarg,
)
from triton_pod import APP_IMPORT_PATH


def _config(deployment: dict[str, Any]) -> dict[str, Any]:
    return {"applications": [{"name": "other", "import_path": "other:app",
                              "deployments": [{"name": "Other", "num_replicas": 7}]},
                             {"name": "triton", "import_path": APP_IMPORT_PATH,
                              "deployments": [deployment]}]}


def test_the_gpu_pods_application_is_found_by_its_import_path_not_its_place() -> None:
    config = _config({"name": "TritonPod", "num_replicas": 2})
    app, deployment, path = triton_app(config)
    assert (app["name"], deployment["name"], path) == (
        "triton", "TritonPod", "spec.serveConfigV2 applications[1]")
    assert replica_bounds(config) == (2, 2)


def test_bounds_of_an_autoscaling_deployment() -> None:
    assert replica_bounds(_config({"autoscaling_config": {"min_replicas": 0,
                                                          "max_replicas": 4}})) == (0, 4)
    assert replica_bounds(_config({"autoscaling_config": {"max_replicas": 4}})) == (1, 4)


def test_a_config_without_the_gpu_pods_application_is_refused() -> None:
    with pytest.raises(NoTritonAppError, match=APP_IMPORT_PATH):
        replica_bounds({"applications": [{"import_path": "other:app"}]})


def test_a_policy_kwarg_is_replaced_only_where_set_and_the_input_is_left_alone() -> None:
    config = _config({"autoscaling_config": {"policy": {"policy_kwargs": {"prewarm_dir": "/x"}}}})
    changed = with_policy_kwarg(config, "prewarm_dir", "/tmp/p")
    assert policy_kwargs(triton_app(changed)[1]) == {"prewarm_dir": "/tmp/p"}
    assert policy_kwargs(triton_app(config)[1]) == {"prewarm_dir": "/x"}
    assert policy_kwargs(triton_app(with_policy_kwarg(config, "prewarm_dir", None))[1]) == {}
    assert "gateway_stats_url" not in policy_kwargs(
        triton_app(with_policy_kwarg(config, "gateway_stats_url", "http://a"))[1])
