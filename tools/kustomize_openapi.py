"""Writes base/openapi.json: the OpenAPI schema that base/kustomization.yaml names
(`openapi:`) so that strategic-merge patches match RayService containers, volumes, env and
worker groups by their keys (`name`, `groupName`) instead of replacing whole lists.

Kustomize uses a custom schema *instead of* its built-in one, so the file holds the Kubernetes
definitions of every kind this repository builds (from the Kubernetes version that the checks
use, as bundled by kubernetes-validate) plus a RayService whose pod templates are Kubernetes'
PodTemplateSpec. Descriptions are dropped: kustomize reads only types, refs and merge keys.

    python -m tools.kustomize_openapi [--check]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate

from schema.check import DEFAULT_KUBERNETES_VERSION
from tools.generated import write_or_check

OUT = Path(__file__).resolve().parent.parent / "base" / "openapi.json"
ROOTS = [
    "io.k8s.api.apps.v1.Deployment", "io.k8s.api.core.v1.Service", "io.k8s.api.core.v1.ConfigMap",
    "io.k8s.api.core.v1.Secret", "io.k8s.api.networking.v1.Ingress",
    "io.k8s.api.networking.v1.NetworkPolicy", "io.k8s.api.policy.v1.PodDisruptionBudget",
]
POD_TEMPLATE = {"$ref": "#/definitions/io.k8s.api.core.v1.PodTemplateSpec"}
RAYSERVICE = {
    "type": "object",
    "x-kubernetes-group-version-kind": [{"group": "ray.io", "kind": "RayService", "version": "v1"}],
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"$ref": "#/definitions/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
        "spec": {"type": "object", "properties": {
            "serveService": {"$ref": "#/definitions/io.k8s.api.core.v1.Service"},
            "rayClusterConfig": {"type": "object", "properties": {
                "headGroupSpec": {"type": "object", "properties": {"template": POD_TEMPLATE}},
                "workerGroupSpecs": {
                    "type": "array",
                    "x-kubernetes-patch-merge-key": "groupName",
                    "x-kubernetes-patch-strategy": "merge",
                    "items": {"type": "object", "properties": {"template": POD_TEMPLATE}},
                },
            }},
        }},
    },
}


def _definitions(version: str) -> dict[str, Any]:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    data = json.loads((root / f"v{version}-local" / "_definitions.json").read_text())
    definitions: dict[str, Any] = data["$defs"]
    return definitions


def _strip(node: Any) -> Any:
    """Drops descriptions and points refs at `#/definitions/`, where kustomize looks."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description":
                continue
            if key == "$ref" and isinstance(value, str):
                value = "#/definitions/" + value.rsplit("/", 1)[-1]
            out[key] = _strip(value)
        return out
    if isinstance(node, list):
        return [_strip(item) for item in node]
    return node


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[-1]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node))
    return set()


def generate(version: str = DEFAULT_KUBERNETES_VERSION) -> dict[str, Any]:
    source = _definitions(version)
    wanted, todo = set(), [*ROOTS, *_refs(RAYSERVICE)]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        todo.extend(_refs(source[name]))
    definitions = {name: _strip(source[name]) for name in sorted(wanted)}
    definitions["io.ray.v1.RayService"] = RAYSERVICE
    return {"x-generated-by": "python -m tools.kustomize_openapi",
            "x-kubernetes-version": version, "definitions": definitions}


def render(schema: dict[str, Any]) -> str:
    # One definition a line: small diffs when Kubernetes changes a type.
    lines = [f'  {json.dumps(name)}: {json.dumps(body, sort_keys=True)}'
             for name, body in schema["definitions"].items()]
    head = {k: v for k, v in schema.items() if k != "definitions"}
    return (json.dumps(head)[:-1] + ', "definitions": {\n' + ",\n".join(lines) + "\n}}\n")


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUT, render(generate()), argv, __doc__, "make schemas")


if __name__ == "__main__":
    sys.exit(main())
