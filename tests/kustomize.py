"""Builds kustomizations with the pinned kubectl (kustomize 5.8) and, where the machine has
it, /usr/bin/kubectl (kustomize 5.5: nothing newer than current Flux may be needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINNED_KUBECTL = Path(sys.executable).with_name("kubectl")
SYSTEM_KUBECTL = Path("/usr/bin/kubectl")
KUBECTLS = [k for k in (PINNED_KUBECTL, SYSTEM_KUBECTL) if k.exists()]
OVERLAYS = sorted(p for p in (ROOT / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def build(directory: Path, kubectl: Path = PINNED_KUBECTL) -> str:
    """`kubectl kustomize` under its default load restrictions."""
    result = subprocess.run(
        [str(kubectl), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        raise AssertionError(f"{kubectl} kustomize {directory} failed:\n{result.stderr}")
    return result.stdout
