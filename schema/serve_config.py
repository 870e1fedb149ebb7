"""Checks a Serve config (the file in serve/, or a RayService's serveConfigV2) with the pinned
Ray's own ServeDeploySchema, and refuses the keys Ray does not know: Serve accepts and silently
ignores them, so a misspelt `max_replica` would leave autoscaling at its default."""

from __future__ import annotations

import importlib
import inspect
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from triton_pod import APP_IMPORT_PATH as FORWARDER_IMPORT_PATH

# Fields typed loosely in Ray's schema, with the model Serve really parses them into.
_LOOSE_FIELDS: dict[tuple[type[BaseModel], str], type[BaseModel]] = {
    (DeploymentSchema, "autoscaling_config"): AutoscalingConfig,
}


def _models_in(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return [annotation]


def _unknown_keys(value: Any, annotation: Any, path: str) -> list[str]:
    problems: list[str] = []
    for candidate in _models_in(annotation):
        origin = typing.get_origin(candidate)
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            if isinstance(value, dict):
                problems += _unknown_model_keys(value, candidate, path)
                break
        elif origin in (list, tuple) and isinstance(value, list):
            (item,) = typing.get_args(candidate)[:1]
            for index, element in enumerate(value):
                problems += _unknown_keys(element, item, f"{path}[{index}]")
            break
        elif origin is dict and isinstance(value, dict):
            args = typing.get_args(candidate)
            if len(args) == 2:
                for key, element in value.items():
                    problems += _unknown_keys(element, args[1], f"{path}.{key}")
            break
    return problems


def _unknown_model_keys(value: dict[str, Any], model: type[BaseModel], path: str) -> list[str]:
    fields = model.model_fields
    names = {alias: name for name, f in fields.items() for alias in (name, f.alias) if alias}
    problems = []
    for key, element in value.items():
        name = names.get(key)
        if name is None:
            problems.append(
                f"{path}.{key}: unknown key (Ray {model.__name__} has no such field and "
                "would ignore it silently)"
            )
            continue
        annotation = _LOOSE_FIELDS.get((model, name), fields[name].annotation)
        problems += _unknown_keys(element, annotation, f"{path}.{key}")
    return problems


def check_serve_config(config: Any, where: str = "serveConfigV2") -> list[str]:
    """Every problem of a Serve config, each naming the field; empty when it is good."""
    if not isinstance(config, dict):
        return [f"{where}: must be a mapping, not {type(config).__name__}"]
    problems = _validation_problems(ServeDeploySchema, config, where)
    problems += _unknown_keys(config, ServeDeploySchema, where)
    for index, app in enumerate(config.get("applications") or []):
        if not isinstance(app, dict):
            continue
        app_path = f"{where}.applications[{index}]"
        for d_index, deployment in enumerate(app.get("deployments") or []):
            auto = deployment.get("autoscaling_config") if isinstance(deployment, dict) else None
            if isinstance(auto, dict):
                # Ray's schema types this field as a plain dict; Serve parses it later.
                auto_path = f"{app_path}.deployments[{d_index}].autoscaling_config"
                problems += _validation_problems(AutoscalingConfig, auto, auto_path)
                problems += _policy_problems(auto.get("policy"), f"{auto_path}.policy")
        if app.get("import_path") == FORWARDER_IMPORT_PATH:
            from triton_pod.pod import TritonPodArgs

            problems += _validation_problems(TritonPodArgs, app.get("args") or {},
                                             f"{app_path}.args")
    return problems


def _policy_problems(policy: Any, path: str) -> list[str]:
    """A policy class is built with its policy_kwargs once, in the Serve controller: a wrong
    keyword would fail there, after the deploy. Build it here instead."""
    if not isinstance(policy, dict) or ":" not in str(policy.get("policy_function", "")):
        return []
    module, _, name = str(policy["policy_function"]).partition(":")
    try:
        target = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        return [f"{path}.policy_function: cannot import {policy['policy_function']}: {error}"]
    if inspect.isclass(target):
        try:
            target(**(policy.get("policy_kwargs") or {}))
        except (TypeError, ValueError) as error:
            return [f"{path}.policy_kwargs: {error}"]
    return []


def _validation_problems(model: type[BaseModel], value: Any, path: str) -> list[str]:
    try:
        model.model_validate(value)
    except ValidationError as error:
        return [
            f"{path}.{'.'.join(str(p) for p in item['loc'])}: {item['msg']}"
            for item in error.errors()
        ]
    return []
