"""The NAME=value files that ConfigMaps' `envs:` sources are (gateway/admission.env, a site's
jwt.env), read as kustomize reads them: one home for the generators and the local stack."""

from __future__ import annotations

from pathlib import Path


def env_file(path: Path) -> dict[str, str]:
    """The NAME=value lines of an env file (a ConfigMap's `envs:` source), comments skipped."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            found[name.strip()] = value.strip()
    return found
