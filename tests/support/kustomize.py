"""Builds kustomizations with the pinned kubectl (kustomize 5.8) and, where the machine has
it, /usr/bin/kubectl (kustomize 5.5: nothing newer than current Flux may be needed)."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from schema.yaml_io import YAML_DUMPER, YAML_LOADER

ROOT = Path(__file__).resolve().parents[2]
PINNED_KUBECTL = Path(sys.executable).with_name("kubectl")
SYSTEM_KUBECTL = Path("/usr/bin/kubectl")
KUBECTLS = [k for k in (PINNED_KUBECTL, SYSTEM_KUBECTL) if k.exists()]
OVERLAYS = sorted(p for p in (ROOT / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def build(directory: Path, kubectl: Path = PINNED_KUBECTL) -> str:
    """`kubectl kustomize` under its default load restrictions, once per distinct input in a
    test session (the tests read the files, never write them): a kustomization that only lists
    one other directory builds exactly as that one does."""
    config = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if set(config) <= {"apiVersion", "kind", "resources"} and len(config["resources"]) == 1:
        return build((directory / config["resources"][0]).resolve(), kubectl)
    return _build(directory.resolve(), kubectl)


@functools.cache
def _build(directory: Path, kubectl: Path) -> str:
    result = subprocess.run(
        [str(kubectl), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        raise AssertionError(f"{kubectl} kustomize {directory} failed:\n{result.stderr}")
    return result.stdout


@functools.cache
def checked(built: str) -> tuple[list[str], int]:
    """schema.check's verdict on a build, once per distinct build (many fixtures build the
    same site)."""
    from schema.check import DEFAULT_KUBERNETES_VERSION, check_stream

    problems, rayservices = check_stream(built, DEFAULT_KUBERNETES_VERSION)
    return list(problems), rayservices


def objects(text: str) -> list[dict[str, Any]]:
    """The objects of a manifest stream."""
    return [o for o in yaml.load_all(text, Loader=YAML_LOADER) if o]


def stream(built: list[dict[str, Any]]) -> str:
    """Objects written back as a manifest stream."""
    return yaml.dump_all(built, Dumper=YAML_DUMPER)
