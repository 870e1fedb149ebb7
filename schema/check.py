"""Checks a built manifest stream (what `kubectl kustomize` prints): the deployment invariants,
KubeRay's RayService schema made strict, the Kubernetes schemas (strict), and each
serveConfigV2 against the pinned Ray's own Serve schema. One line per violation, naming the
invariant, the object and the field; exit status 1 when any fails.

    python -m schema.check [--kubernetes-version X.Y.Z] MANIFEST [MANIFEST ...]   (- = stdin)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml

from schema.facts import admission_settings, extract
from schema.serve_config import check_serve_config
from schema.yaml_io import YAML_LOADER

HERE = Path(__file__).resolve().parent
# kubernetes-validate parses its 1.4 MB definitions file again for every object it checks:
# parse each schema file once (the validator only reads them).
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(  # type: ignore[method-assign]
    kubernetes_validate.utils.schema_contents)
INVARIANTS = json.loads((HERE / "invariants.schema.json").read_text())
RAYSERVICE_SCHEMA = json.loads((HERE / "generated" / "kuberay-v1.7.0-rayservice.json").read_text())
# The Kubernetes whose schemas every built object is checked against: the one home of it.
DEFAULT_KUBERNETES_VERSION = "1.33.0"


def _name(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{obj.get('kind')} {ns + '/' if ns else ''}{meta.get('name')}"


def _dotted(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _deepest(schema: dict[str, Any], schema_path: Any, key: str) -> dict[str, Any]:
    """The deepest subschema holding `key` along the failing schema path."""
    node: Any = schema
    best: dict[str, Any] = schema
    for part in schema_path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            break
        if isinstance(node, dict) and key in node:
            best = node
    return best


def invariant_violations(obj: dict[str, Any],
                         stream: list[dict[str, Any]] | None = None) -> Iterator[str]:
    facts = extract(obj, stream)
    validator = jsonschema.Draft202012Validator(INVARIANTS)
    missing_facts = [name for name in INVARIANTS["required"] if name not in facts.values]
    for error in sorted(validator.iter_errors(facts.values), key=lambda e: list(e.absolute_path)):
        if error.validator == "required" and not error.absolute_path:
            # A fact no object of the build gave: say which rule reads it and what it is.
            missing = missing_facts.pop(0)
            rule = INVARIANTS["properties"].get(missing, {})
            yield (f"{rule.get('title', missing)}: {_name(obj)} (the build): nothing in it gives "
                   f"{rule.get('x-fact', missing)} (a renamed or missing object) - "
                   f"{rule.get('description', '')}")
            continue
        rule = _deepest(INVARIANTS, error.absolute_schema_path, "title")
        # A rule with several cases words each where it states it.
        worded = _deepest(INVARIANTS, error.absolute_schema_path, "x-message")
        pointer = "".join(f"/{p}" for p in error.absolute_path)
        source = next((facts.sources[p] for p in _prefixes(pointer) if p in facts.sources),
                      "(whole object)")
        label = rule.get("x-fact", "the value")
        message = f"{label} is {json.dumps(error.instance)}"
        if error.validator == "minItems" and error.instance == []:
            message = f"{label}: none"
        if "x-message" in worded:
            # The rule's own wording (schema/invariants.schema.json), with the failing value
            # and the fact around it.
            parent = _at(facts.values, list(error.absolute_path)[:-1])
            message = worded["x-message"].format(label=label, instance=json.dumps(error.instance),
                                               parent=parent if isinstance(parent, dict) else {})
        if error.validator == "uniqueItems":
            clashes = {str(p): facts.port_owners.get(str(p), []) for p in error.instance
                       if error.instance.count(p) > 1}
            message = "; ".join(f"port {p} is bound by {' and '.join(sorted(set(o)))}"
                                for p, o in clashes.items())
        yield (f"{rule.get('title', 'invariant')}: {_name(obj)} {source}: {message} "
               f"- {rule.get('description', '')}")


def admission_problems(settings: Mapping[str, Any]) -> list[str]:
    """Invariant admission-settings-valid on the `admission` settings alone (what make local
    gives its gateway): the rule's own words for each bad one."""
    rule = INVARIANTS["properties"]["admissionSettings"]
    errors = jsonschema.Draft202012Validator(rule).iter_errors(admission_settings(settings))
    return [_deepest(rule, e.absolute_schema_path, "x-message").get("x-message", e.message)
            .format(instance=json.dumps(e.instance), label=rule["x-fact"], parent={})
            for e in sorted(errors, key=lambda e: list(e.absolute_path))]


def _at(values: Any, path: list[Any]) -> Any:
    for key in path:
        values = values[key]
    return values


def _prefixes(pointer: str) -> list[str]:
    parts = pointer.split("/")
    return ["/".join(parts[:n]) for n in range(len(parts), 1, -1)]


# Fields an older KubeRay drops silently (the API server prunes what its CRD does not know).
_SINCE = {"resources": "worker-group resources need KubeRay >= 1.5",
          "authOptions": "authOptions needs KubeRay >= 1.5.1"}


def crd_violations(obj: dict[str, Any], schema: dict[str, Any]) -> Iterator[str]:
    validator = jsonschema.Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        hints = [hint for field, hint in _SINCE.items() if f"'{field}'" in error.message]
        hint = f" ({'; '.join(hints)}: this cluster would drop it silently)" if hints else ""
        yield (f"kuberay-crd: {_name(obj)} {_dotted(error.absolute_path) or '(object)'}: "
               f"{error.message}{hint}")


def rayservice_violations(obj: dict[str, Any], stream: list[dict[str, Any]] | None = None,
                          crd_schema: dict[str, Any] | None = None) -> Iterator[str]:
    yield from crd_violations(obj, crd_schema or RAYSERVICE_SCHEMA)
    config_text = (obj.get("spec") or {}).get("serveConfigV2")
    try:
        config = yaml.load(config_text or "", Loader=YAML_LOADER)
    except yaml.YAMLError as error:
        yield f"serve-config: {_name(obj)} spec.serveConfigV2: not YAML ({error})"
        return
    for problem in check_serve_config(config, "spec.serveConfigV2"):
        yield f"serve-config: {_name(obj)} {problem}"
    yield from invariant_violations(obj, stream)


def kubernetes_violations(obj: dict[str, Any], version: str) -> Iterator[str]:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return  # a custom resource (ServiceMonitor, …): no schema here to hold it to
    except kubernetes_validate.ValidationError as error:
        path = _dotted(error.path) or "(object)"
        yield f"kubernetes-schema: {_name(obj)} {path}: {error.message}"


def check_stream(text: str, kubernetes_version: str,
                 crd_schema: dict[str, Any] | None = None) -> tuple[list[str], int]:
    """Violations of every object in a manifest stream, and how many RayServices it holds."""
    try:
        objects = [o for o in yaml.load_all(text, Loader=YAML_LOADER) if o is not None]
    except yaml.YAMLError as error:
        return [f"yaml: the manifest is not YAML: {error}"], 0
    problems: list[str] = []
    rayservices = 0
    for obj in objects:
        if not isinstance(obj, dict) or "kind" not in obj:
            problems.append(f"yaml: not a Kubernetes object: {str(obj)[:80]}")
            continue
        if obj["kind"] == "RayService":
            rayservices += 1
            problems += rayservice_violations(obj, objects, crd_schema)
        else:
            problems += kubernetes_violations(obj, kubernetes_version)
    if rayservices == 0:
        problems.append("rayservice-present: the manifest holds no RayService")
    return problems, rayservices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("manifests", nargs="+")
    parser.add_argument("--kubernetes-version", default=DEFAULT_KUBERNETES_VERSION)
    parser.add_argument("--crd", help="check RayServices against this cluster's installed "
                        "RayService CRD (kubectl get crd rayservices.ray.io -o yaml) instead "
                        "of KubeRay v1.7.0's")
    args = parser.parse_args(argv)
    crd_schema = None
    if args.crd:
        from schema.crd_to_jsonschema import generate

        crd_schema = generate(args.crd, "v1")
    failed = False
    for manifest in args.manifests:
        text = sys.stdin.read() if manifest == "-" else Path(manifest).read_text()
        problems, rayservices = check_stream(text, args.kubernetes_version, crd_schema)
        for problem in problems:
            print(problem)
        failed |= bool(problems)
        verdict = f"{len(problems)} violation(s)" if problems else "ok"
        print(f"{manifest}: {verdict} ({rayservices} RayService(s))", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
