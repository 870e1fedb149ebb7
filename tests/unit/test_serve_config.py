"""The Serve config in serve/ against the pinned Ray's own schema, with unknown keys refused."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from schema.serve_config import check_serve_config

CONFIG = Path(__file__).resolve().parents[2] / "serve" / "serve-config.yaml"


@pytest.fixture()
def config() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    return loaded


def test_serve_config_is_valid(config: dict[str, Any]) -> None:
    assert check_serve_config(config) == []


def test_serve_config_has_what_the_forwarder_needs(config: dict[str, Any]) -> None:
    assert config["grpc_options"]["grpc_servicer_functions"] == [
        "triton_pod.servicer.add_triton_servicer"
    ]
    (app,) = config["applications"]
    (deployment,) = app["deployments"]
    auto = deployment["autoscaling_config"]
    assert 1 <= auto["min_replicas"] <= auto["max_replicas"]
    assert {"upscale_delay_s", "downscale_delay_s"} <= set(auto)
    assert auto["policy"]["policy_function"] == "triton_pod.autoscaling:TritonQueueTimePolicy"
    assert deployment["ray_actor_options"] == {"num_cpus": 0, "resources": {"triton": 1}}
    assert deployment["graceful_shutdown_timeout_s"] > 0


def _dig(config: dict[str, Any], path: str) -> dict[str, Any]:
    node: Any = config
    for part in path.split("/"):
        node = node[int(part)] if part.isdigit() else node[part]
    assert isinstance(node, dict)
    return node


@pytest.mark.parametrize(
    ("where", "key", "value", "named"),
    [
        ("applications/0/deployments/0/autoscaling_config", "max_replica", 3,
         "autoscaling_config.max_replica: unknown key"),
        ("applications/0/deployments/0", "max_ongoing_request", 3,
         "deployments[0].max_ongoing_request: unknown key"),
        ("applications/0/deployments/0/ray_actor_options", "num_gpu", 1,
         "ray_actor_options.num_gpu: unknown key"),
        ("grpc_options", "prot", 9001, "grpc_options.prot: unknown key"),
        ("applications/0/args", "triton_adress", "x:1", "args.triton_adress"),
        ("applications/0/args", "allowed_admin_rpcs", ["ModelInfer"], "allowed_admin_rpcs"),
        ("applications/0/deployments/0/autoscaling_config", "min_replicas", -1,
         "autoscaling_config.min_replicas"),
        ("applications/0/deployments/0/autoscaling_config/policy/policy_kwargs",
         "target_queue_ms", 50, "policy.policy_kwargs: "),
        ("applications/0/deployments/0/autoscaling_config/policy/policy_kwargs",
         "target_queue_ms_per_exec", 0, "policy.policy_kwargs: target_queue_ms_per_exec"),
    ],
)
def test_bad_serve_config_is_refused_naming_the_field(
    config: dict[str, Any], where: str, key: str, value: Any, named: str
) -> None:
    bad = copy.deepcopy(config)
    _dig(bad, where)[key] = value
    problems = check_serve_config(bad)
    assert any(named in problem for problem in problems), problems
