"""`make prewarm`: at least PODS GPU pods until UNTIL, ahead of a campaign, without editing the
Serve config or redeploying (docs/operations.md, "Pre-warming").

Checked before anything is written: PODS a whole number from 1 to the deployment's
max_replicas (read from the site's build, or from SERVE_CONFIG for a local stack), UNTIL an
ISO 8601 time with its zone, in the future. Then, for a site (OVERLAY), the ConfigMap
`prewarm` in the RayService's namespace through `kubectl apply` (DRY_RUN=1 prints it only);
for a local stack (DIR, the directory its `pre-warm:` line names), the same two files, each
replaced whole as the kubelet projects a ConfigMap. The autoscaling policy reads the request
at most a second later (a site's kubelet takes up to about a minute to project a change),
holds the floor until UNTIL passes, and then forgets it: nothing to undo.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from schema.serve_app import NoTritonAppError, replica_bounds
from triton_pod.prewarm import CONFIG_MAP, PODS_KEY, UNTIL_KEY, Prewarm, PrewarmError, parse

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SERVE_CONFIG = REPO / "serve" / "serve-config.yaml"


def bounds(serve_config: dict[str, Any], where: str) -> tuple[int, int]:
    """The deployment's min_replicas and max_replicas."""
    try:
        return replica_bounds(serve_config)
    except NoTritonAppError as error:
        raise SystemExit(f"{where}: {error}") from None


def checked(pods: str, until: str, most: int, now: datetime) -> Prewarm:
    try:
        request = parse(pods, until, ("PODS", "UNTIL"))
    except PrewarmError as error:
        raise SystemExit(f"make prewarm: {error}") from None
    if request.pods > most:
        raise SystemExit(f"make prewarm: PODS={request.pods} is above max_replicas "
                         f"({most}): the deployment never runs more")
    if request.until <= now:
        raise SystemExit(f"make prewarm: UNTIL={until.strip()} is not in the future (now "
                         f"{now.isoformat(timespec='seconds')})")
    return request


def config_map(request: Prewarm, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": CONFIG_MAP, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": "sonic-ray",
                                    "app.kubernetes.io/component": "prewarm"}},
            "data": {PODS_KEY: str(request.pods), UNTIL_KEY: request.until.isoformat()}}


def write_dir(request: Prewarm, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for key, value in ((PODS_KEY, str(request.pods)), (UNTIL_KEY, request.until.isoformat())):
        part = directory / f".{key}.new"
        part.write_text(value + "\n")
        os.replace(part, directory / key)


def _site(overlay: Path, kubectl: str) -> tuple[dict[str, Any], str]:
    """The overlay's Serve config and the RayService's namespace, from a real build."""
    built = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"kubectl kustomize {overlay} failed: {built.stderr.strip()}")
    for obj in yaml.safe_load_all(built.stdout):
        if isinstance(obj, dict) and obj.get("kind") == "RayService":
            config = yaml.safe_load((obj.get("spec") or {}).get("serveConfigV2") or "") or {}
            return config, (obj.get("metadata") or {}).get("namespace") or "default"
    raise SystemExit(f"{overlay}: the build has no RayService")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make prewarm", description=__doc__.split("\n")[0])
    parser.add_argument("--pods", required=True)
    parser.add_argument("--until", required=True)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--overlay", type=Path)
    where.add_argument("--dir", type=Path)
    parser.add_argument("--serve-config", type=Path)
    parser.add_argument("--kubectl", default="kubectl")
    parser.add_argument("--build-kubectl", default=str(Path(sys.executable).with_name("kubectl")))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    now = datetime.now(UTC)
    if args.dir is not None:
        path = args.serve_config or DEFAULT_SERVE_CONFIG
        if not path.is_file():
            raise SystemExit(f"make prewarm: SERVE_CONFIG={path} is not a file")
        _, most = bounds(yaml.safe_load(path.read_text()) or {}, str(path))
        request = checked(args.pods, args.until, most, now)
        write_dir(request, args.dir)
        print(f"pre-warm: {request.describe()} (written to {args.dir})")
        return 0
    if not args.overlay.is_dir():
        raise SystemExit(f"make prewarm: OVERLAY={args.overlay} is not a directory")
    config, namespace = _site(args.overlay, args.build_kubectl)
    _, most = bounds(config, f"{args.overlay} spec.serveConfigV2")
    request = checked(args.pods, args.until, most, now)
    text = yaml.safe_dump(config_map(request, namespace), sort_keys=False)
    if args.dry_run:
        print(text, end="")
        return 0
    applied = subprocess.run([args.kubectl, "apply", "-f", "-"], input=text, text=True)
    if applied.returncode != 0:
        raise SystemExit(f"make prewarm: kubectl apply failed (status {applied.returncode})")
    print(f"pre-warm: {request.describe()} (ConfigMap {CONFIG_MAP} in namespace {namespace})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
