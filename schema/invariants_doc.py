"""Writes docs/invariants.md, the list of every invariant `make check` holds a build to, from
schema/invariants.schema.json (each rule's title and description) and the checks schema/check.py
adds around it: the one home of the rules stays the schema, and the page cannot drift from it.

    python -m schema.invariants_doc [--check]
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tools.generated import ROOT, write_or_check

SCHEMA = ROOT / "schema" / "invariants.schema.json"
PAGE = ROOT / "docs" / "invariants.md"
FIXTURES = "tests/fixtures/invariants"
# What schema/check.py checks beside the invariants' schema, in its own words.
CHECKS_BESIDE = {
    "kuberay-crd": "The RayService against KubeRay v1.7.0's CRD schema made strict "
                   "(schema/generated/, made by `make schemas`): unknown fields refused.",
    "kubernetes-schema": "Every other built-in object against Kubernetes' schemas "
                         "(kubernetes-validate --strict, DEFAULT_KUBERNETES_VERSION in "
                         "schema/check.py).",
    "serve-config": "serveConfigV2 against the pinned Ray's own ServeDeploySchema, keys Ray "
                    "would ignore silently refused, and the GPU pods' app's args.",
}


def rules(node: Any, found: dict[str, list[str]]) -> dict[str, list[str]]:
    """Every titled rule below the schema's root, its descriptions in schema order."""
    if isinstance(node, dict):
        if "title" in node and "description" in node and node.get("$schema") is None:
            descriptions = found.setdefault(node["title"], [])
            if node["description"] not in descriptions:
                descriptions.append(node["description"])
        for value in node.values():
            rules(value, found)
    elif isinstance(node, list):
        for value in node:
            rules(value, found)
    return found


def render() -> str:
    found = rules(json.loads(SCHEMA.read_text()), {})
    lines = ["# Invariants", "",
             "Written by `make generate` (schema/invariants_doc.py) from",
             "schema/invariants.schema.json; edit the schema, not this page. `make check",
             "MANIFEST=<built file>` and `make validate` hold every build to these, one line per",
             "violation naming the invariant, the object and the field. Each has a known-good and",
             f"a known-bad build in `{FIXTURES}/<invariant>/` (allowed/, disallowed/).", "",
             f"{len(found)} invariants, and {len(CHECKS_BESIDE)} schema checks beside them.", ""]
    for title in sorted(found):
        lines += [f"- **{title}**: " + " ".join(found[title])]
    lines += ["", "## Schema checks", ""]
    lines += [f"- **{name}**: {words}" for name, words in CHECKS_BESIDE.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(PAGE, render(), argv, __doc__, "make generate")


if __name__ == "__main__":
    sys.exit(main())
