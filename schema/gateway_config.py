"""The gateway's Envoy config (gateway/envoy.yaml) and what it must agree with.

Its refused-RPC routes are written from the one allow-list, `allowed_admin_rpcs` in the Serve
config's args, and the RPC table (serve/triton_forwarder/rpcs.py): `make gateway-config`
rewrites the block between the markers, and the checks refuse a config whose routes differ,
so both data paths refuse the same calls with the same words.

    python -m schema.gateway_config [--check]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from schema import write_or_check
from triton_forwarder.access import ADMIN_HEADER, ADMIN_KEY_ENV
from triton_forwarder.rpcs import RPCS, refusal_message

ROOT = Path(__file__).resolve().parent.parent
ENVOY_CONFIG = ROOT / "gateway" / "envoy.yaml"
SERVE_CONFIG = ROOT / "serve" / "serve-config.yaml"
BEGIN = "# BEGIN refused-rpcs"
END = "# END refused-rpcs"
# grpc-status 7, PERMISSION_DENIED: what Envoy answers a gRPC call for HTTP 403.
REFUSAL_STATUS = 403


def allowed_admin_rpcs(serve_config: dict[str, Any]) -> list[str]:
    for app in serve_config.get("applications") or []:
        allowed = (app.get("args") or {}).get("allowed_admin_rpcs")
        if allowed is not None:
            return list(allowed)
    return []


def refused_routes(allowed: list[str]) -> list[dict[str, Any]]:
    """A refusal for each refused RPC not allowed; the admin key (from the gateway's own
    environment, never from the client) on each RPC of Triton's restricted groups that passes."""
    routes: list[dict[str, Any]] = []
    for rpc in RPCS:
        if rpc.refusal and rpc.name not in allowed:
            routes.append({"match": {"path": rpc.path},
                           "direct_response": {"status": REFUSAL_STATUS,
                                               "body": {"inline_string": refusal_message(rpc)}}})
        elif rpc.restricted:
            routes.append({"match": {"path": rpc.path},
                           "route": {"cluster": "triton", "timeout": "0s",
                                     "max_stream_duration": {"grpc_timeout_header_max": "0s"}},
                           "request_headers_to_add": [{"header": {
                               "key": ADMIN_HEADER,
                               "value": f"%ENVIRONMENT({ADMIN_KEY_ENV})%"}}]})
    return routes


def render(text: str, allowed: list[str]) -> str:
    """The config text with the block between the markers written from the allow-list."""
    lines = text.splitlines(keepends=True)
    begin = next(i for i, line in enumerate(lines) if BEGIN in line)
    end = next(i for i, line in enumerate(lines) if END in line)
    indent = lines[end][: len(lines[end]) - len(lines[end].lstrip())]
    routes = []
    for route in refused_routes(allowed):
        # One flow-style line per route: JSON is YAML, and the messages stay greppable.
        routes.append(f"{indent}- {json.dumps(route)}\n")
    header_end = begin
    while header_end + 1 < end and lines[header_end + 1].lstrip().startswith("#"):
        header_end += 1
    return "".join(lines[: header_end + 1] + routes + lines[end:])


def named(envoy: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    """The listener or cluster (`kind`: listeners, clusters) of that name; {} when absent."""
    items = (envoy.get("static_resources") or {}).get(kind) or []
    found: dict[str, Any] = next((i for i in items if i.get("name") == name), {})
    return found


def triton_routes(envoy: dict[str, Any]) -> list[dict[str, Any]]:
    listener = named(envoy, "listeners", "triton-grpc")
    if not listener:
        return []
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes: list[dict[str, Any]] = manager["route_config"]["virtual_hosts"][0]["routes"]
    return routes


def refusal_problems(envoy: dict[str, Any], serve_config: dict[str, Any]) -> list[str]:
    """How the config's refused routes differ from what the allow-list asks for."""
    wanted = {r["match"]["path"]: r for r in refused_routes(allowed_admin_rpcs(serve_config))
              if "direct_response" in r}
    present = {r.get("match", {}).get("path"): r for r in triton_routes(envoy)
               if "direct_response" in r}
    problems = []
    for path in sorted(set(wanted) - set(present)):
        problems.append(f"{path} is not refused, but allowed_admin_rpcs does not allow it")
    for path in sorted(set(present) - set(wanted)):
        problems.append(f"{path} is refused, but allowed_admin_rpcs allows it")
    for path in sorted(set(wanted) & set(present)):
        if present[path] != wanted[path]:
            problems.append(f"{path} is refused with another status or message than "
                            "serve/triton_forwarder/rpcs.py gives")
    return problems


def main(argv: list[str] | None = None) -> int:
    text = ENVOY_CONFIG.read_text()
    rendered = render(text, allowed_admin_rpcs(yaml.safe_load(SERVE_CONFIG.read_text())))
    return write_or_check(ENVOY_CONFIG, rendered, argv, __doc__, "make gateway-config")


if __name__ == "__main__":
    sys.exit(main())
