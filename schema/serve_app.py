"""Where a Serve config holds the GPU pods' application: its deployment, the replica bounds and
the autoscaling policy's kwargs. One reader for the checks (schema/facts.py), the local stacks
and `make prewarm` (tools/prewarm.py), so that they agree on which deployment is meant."""

from __future__ import annotations

import copy
from typing import Any

from triton_pod import APP_IMPORT_PATH


class NoTritonAppError(ValueError):
    """The Serve config has no application that imports the GPU pods' app."""


def triton_app(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The application importing APP_IMPORT_PATH, its first deployment and the application's
    path in a RayService (empty dicts when there is none: the checks report that themselves)."""
    for index, app in enumerate(config.get("applications") or []):
        if isinstance(app, dict) and app.get("import_path") == APP_IMPORT_PATH:
            deployments = app.get("deployments") or [{}]
            return app, deployments[0], f"spec.serveConfigV2 applications[{index}]"
    return {}, {}, "spec.serveConfigV2 applications"


def policy_kwargs(deployment: dict[str, Any]) -> dict[str, Any]:
    """The kwargs the deployment's autoscaling policy is built with (none: {})."""
    policy = (deployment.get("autoscaling_config") or {}).get("policy") or {}
    kwargs = policy.get("policy_kwargs") if isinstance(policy, dict) else None
    return kwargs if isinstance(kwargs, dict) else {}


def bounds_as_written(deployment: dict[str, Any]) -> tuple[Any, Any]:
    """The deployment's min_replicas and max_replicas as the config writes them (num_replicas
    for both when it does not autoscale; Serve's defaults where left out)."""
    auto = deployment.get("autoscaling_config")
    if auto is None:
        fixed = deployment.get("num_replicas", 1)
        return fixed, fixed
    low = auto.get("min_replicas", 1)
    return low, auto.get("max_replicas", low)


def replica_bounds(config: dict[str, Any]) -> tuple[int, int]:
    """The GPU pods' min_replicas and max_replicas."""
    app, deployment, _ = triton_app(config)
    if not app:
        raise NoTritonAppError(f"no application imports {APP_IMPORT_PATH}")
    low, high = bounds_as_written(deployment)
    return int(low), int(high)


def with_policy_kwarg(config: dict[str, Any], key: str, value: str | None) -> dict[str, Any]:
    """A copy of the config where the policy's kwarg `key`, if it is set, is `value` (None:
    removed): the local stacks' own address or directory in place of the cluster's."""
    changed = copy.deepcopy(config)
    _, deployment, _ = triton_app(changed)
    kwargs = policy_kwargs(deployment)
    if key in kwargs:
        if value is None:
            del kwargs[key]
        else:
            kwargs[key] = value
    return changed
