"""The gateway's Envoy config (gateway/envoy.yaml) and what it must agree with.

Its refused-RPC routes are written from the one allow-list, `allowed_admin_rpcs` in the Serve
config's args, and the RPC table (serve/triton_pod/rpcs.py): `make gateway-config`
rewrites the block between the markers, and the checks refuse a config whose routes differ,
so both data paths refuse the same calls with the same words. Its retries and its retry
priority's update frequency are written from the Serve config's max_replicas
(sequence_retries, tries_per_priority): a sequence's call reaches every ready GPU pod, then
every pod that holds live sequences.

    python -m gateway.routes [--check]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from tools.generated import write_or_check
from triton_pod.access import ADMIN_HEADER, ADMIN_KEY_ENV, HTTP_ADMIN_HEADER
from triton_pod.rpcs import HTTP_RESTRICTED, RPCS, refusal_message
from triton_pod.sequences import SEQUENCE_NOT_HELD

ROOT = Path(__file__).resolve().parent.parent
ENVOY_CONFIG = ROOT / "gateway" / "envoy.yaml"
SERVE_CONFIG = ROOT / "serve" / "serve-config.yaml"
# The generated blocks: the gRPC listener's routes, then the HTTP listener's.
GRPC_BLOCK = "refused-rpcs"
HTTP_BLOCK = "refused-http"
# The listeners and the Triton clusters they route to.
GRPC_LISTENER, GRPC_CLUSTER = "triton-grpc", "triton"
HTTP_LISTENER, HTTP_CLUSTER = "triton-http", "triton-http"
# Where client-checks.lua asks whether the GPUs are saturated (the Ray head's admission port).
CONTROL_PLANE_CLUSTER = "control-plane"
# grpc-status 7, PERMISSION_DENIED: what Envoy answers a gRPC call for HTTP 403.
REFUSAL_STATUS = 403
# Triton's words (grpc-message) for a call of a sequence whose START it never saw
# (SEQUENCE_NOT_HELD, whose home is the Serve path's serve/triton_pod/sequences.py): the retry
# policies of envoy.yaml try such a call on the other Tritons; over HTTP Triton says it only in
# the body of a 400.
SEQUENCE_NOT_HELD_HTTP_STATUS = 400
# The one line of envoy.yaml that says how many retries its policies make (a YAML anchor the
# others refer to), written by `make gateway-config` from the Serve config (sequence_retries).
RETRIES_LINE = re.compile(r"^(\s*num_retries: &retries )\d+( .*)?$", re.M)
MIN_RETRIES = 3
# The line that says after how many tries of ready pods a call may go to a leaving one
# (previous_priorities' update_frequency), written from the Serve config (tries_per_priority).
TRIES_PER_PRIORITY_LINE = re.compile(r"^(\s*update_frequency: &tries-per-priority )\d+( .*)?$",
                                     re.M)


# The filter gateway/callers.sh writes the config of (gateway/envoy.yaml), and a route's word
# that a filter stays out of its calls.
CALLERS_FILTER = "sonic-ray.callers"
FILTER_OFF = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}


def allowed_admin_rpcs(serve_config: dict[str, Any]) -> list[str]:
    for app in serve_config.get("applications") or []:
        allowed = (app.get("args") or {}).get("allowed_admin_rpcs")
        if allowed is not None:
            return list(allowed)
    return []


def _refused(match: dict[str, Any], message: str) -> dict[str, Any]:
    return {"match": match, "direct_response": {"status": REFUSAL_STATUS,
                                                "body": {"inline_string": message}}}


def _with_admin_key(match: dict[str, Any], route: dict[str, Any], header: str) -> dict[str, Any]:
    # The key comes from the gateway's own environment, never from the client. The client
    # checks' Lua checks these calls (RepositoryIndex is a job start), so the callers filter,
    # whose fallback may be that same Lua, is off here.
    return {"match": match, "route": route, "request_headers_to_add": [
        {"header": {"key": header, "value": f"%ENVIRONMENT({ADMIN_KEY_ENV})%"}}],
        "typed_per_filter_config": {CALLERS_FILTER: FILTER_OFF}}


def refused_routes(allowed: list[str]) -> list[dict[str, Any]]:
    """A refusal for each refused RPC not allowed; the admin key on each RPC of Triton's
    restricted groups that passes."""
    route = {"cluster": GRPC_CLUSTER, "timeout": "0s",
             "max_stream_duration": {"grpc_timeout_header_max": "0s"}}
    return [_refused({"path": rpc.path}, refusal_message(rpc))
            if rpc.refused(allowed)
            else _with_admin_key({"path": rpc.path}, route, ADMIN_HEADER)
            for rpc in RPCS if rpc.restricted or rpc.refused(allowed)]


def refused_http_routes(allowed: list[str]) -> list[dict[str, Any]]:
    """The same for Triton's HTTP API: the listener's local_reply_config turns a refusal's text
    into Triton's error shape, {"error": "..."}."""
    route = {"cluster": HTTP_CLUSTER, "timeout": "0s"}
    return [_refused({"safe_regex": {"regex": rpc.http_path}}, refusal_message(rpc))
            if rpc.refused(allowed)
            else _with_admin_key({"safe_regex": {"regex": rpc.http_path}}, route,
                                 HTTP_ADMIN_HEADER)
            for rpc in HTTP_RESTRICTED]


def _render_block(lines: list[str], block: str, routes: list[dict[str, Any]]) -> list[str]:
    begin = next(i for i, line in enumerate(lines) if f"# BEGIN {block}" in line)
    end = next(i for i, line in enumerate(lines) if f"# END {block}" in line)
    indent = lines[end][: len(lines[end]) - len(lines[end].lstrip())]
    # One flow-style line per route: JSON is YAML, and the messages stay greppable.
    written = [f"{indent}- {json.dumps(route)}\n" for route in routes]
    header_end = begin
    while header_end + 1 < end and lines[header_end + 1].lstrip().startswith("#"):
        header_end += 1
    return lines[: header_end + 1] + written + lines[end:]


def ready_pods(serve_config: dict[str, Any]) -> int | None:
    """The most GPU pods the Serve config allows (max_replicas), or None when it names none."""
    for app in serve_config.get("applications") or []:
        for deployment in app.get("deployments") or []:
            pods = (deployment.get("autoscaling_config") or {}).get("max_replicas")
            if isinstance(pods, int):
                return pods
    return None


# A round's tries per GPU pod that max_replicas allows (tries_per_priority).
TRIES_PER_POD = 2


def tries_per_priority(serve_config: dict[str, Any]) -> int | None:
    """The tries a sequence's call makes at one priority before the retry priority moves on
    (previous_priorities' update_frequency): twice max_replicas, since priority 1 lists every
    pod holding live sequences, which in an upgrade may be all of both clusters' pods (the
    ready ones at priority 0 are fewer: a try beyond them asks one of them again). None when
    the Serve config names no max_replicas."""
    pods = ready_pods(serve_config)
    return None if pods is None else TRIES_PER_POD * pods


# Rounds of tries_per_priority tries a sequence's call may need: at the ready pods
# (priority 0), then at the pods holding live sequences (priority 1); and one more at the
# ready pods before those when its first round met both priorities (no ready pod healthy when
# it began, one healthy by a later try, as at an upgrade's switch): previous_priorities then
# finds every priority tried, starts again from the ready pods and counts its round anew.
SEQUENCE_ROUNDS = 3


def tries_needed(pods: int) -> int:
    """The tries a sequence's call may need to reach the pod holding it with `pods` as Serve's
    max_replicas: SEQUENCE_ROUNDS rounds of tries_per_priority."""
    return SEQUENCE_ROUNDS * TRIES_PER_POD * pods


def sequence_retries(serve_config: dict[str, Any]) -> int:
    """The retries of the gateway's retry policies: enough for a sequence's call to make the
    tries_needed (6 x max_replicas), and never fewer than 3 (a call no Triton ran, on another
    Triton); no more, since each retry of a refused call is another Triton's work (a
    malformed HTTP inference is refused by each Triton tried)."""
    pods = ready_pods(serve_config)
    return MIN_RETRIES if pods is None else max(MIN_RETRIES, tries_needed(pods) - 1)


def render(text: str, allowed: list[str], retries: int = 0,
           per_priority: int | None = None) -> str:
    """The config text with the blocks between the markers written from the allow-list, the
    retries line (RETRIES_LINE) from `retries` (0: as it is) and the update frequency's line
    (TRIES_PER_PRIORITY_LINE) from `per_priority` (None: as it is)."""
    if retries:
        text = RETRIES_LINE.sub(rf"\g<1>{retries}\g<2>", text)
    if per_priority:
        text = TRIES_PER_PRIORITY_LINE.sub(rf"\g<1>{per_priority}\g<2>", text)
    lines = text.splitlines(keepends=True)
    lines = _render_block(lines, GRPC_BLOCK, refused_routes(allowed))
    lines = _render_block(lines, HTTP_BLOCK, refused_http_routes(allowed))
    return "".join(lines)


def named(envoy: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    """The listener or cluster (`kind`: listeners, clusters) of that name; {} when absent."""
    items = (envoy.get("static_resources") or {}).get(kind) or []
    found: dict[str, Any] = next((i for i in items if i.get("name") == name), {})
    return found


def http_filters(envoy: dict[str, Any]) -> list[dict[str, Any]]:
    """Every HTTP filter of every listener, in order (a YAML alias's twice)."""
    return [http_filter
            for listener in (envoy.get("static_resources") or {}).get("listeners") or []
            for chain in listener.get("filter_chains") or []
            for network_filter in chain.get("filters") or []
            for http_filter in (network_filter.get("typed_config") or {}).get("http_filters")
            or []]


def file_access_logs(envoy: dict[str, Any]) -> list[dict[str, Any]]:
    """The typed_config of every file access log of every listener (a YAML alias's twice)."""
    return [log["typed_config"]
            for listener in (envoy.get("static_resources") or {}).get("listeners") or []
            for chain in listener.get("filter_chains") or []
            for network_filter in chain.get("filters") or []
            for log in (network_filter.get("typed_config") or {}).get("access_log") or []
            if log.get("name") == "envoy.access_loggers.file"]


def discovery_source(http_filter: dict[str, Any]) -> dict[str, Any]:
    """The path_config_source of a filter whose config comes by discovery from a file; {}."""
    source: dict[str, Any] = ((http_filter.get("config_discovery") or {}).get(
        "config_source") or {}).get("path_config_source") or {}
    return source


def listener_routes(envoy: dict[str, Any], name: str) -> list[dict[str, Any]]:
    listener = named(envoy, "listeners", name)
    if not listener:
        return []
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes: list[dict[str, Any]] = manager["route_config"]["virtual_hosts"][0]["routes"]
    return routes


def retries_sequences(policy: dict[str, Any]) -> bool:
    """Whether a retry policy tries a call Triton refused as not holding its sequence again."""
    retry_on = str(policy.get("retry_on") or "").split(",")
    by_words = "retriable-headers" in retry_on and any(
        h.get("name") == "grpc-message" and SEQUENCE_NOT_HELD in str(
            (h.get("string_match") or {}).get("contains", ""))
        for h in policy.get("retriable_headers") or [])
    by_status = "retriable-status-codes" in retry_on and SEQUENCE_NOT_HELD_HTTP_STATUS in (
        policy.get("retriable_status_codes") or [])
    return by_words or by_status


def virtual_hosts(envoy: dict[str, Any], listener: str) -> list[dict[str, Any]]:
    """The virtual hosts of a listener's every filter chain (the TLS chains share theirs)."""
    return [host for chain in named(envoy, "listeners", listener).get("filter_chains") or []
            for network_filter in chain.get("filters") or []
            for host in (((network_filter.get("typed_config") or {}).get("route_config") or {})
                         .get("virtual_hosts") or [])]


def retry_holders(envoy: dict[str, Any]) -> list[dict[str, Any]]:
    """What may hold a retry policy on the client listeners: each virtual host and route."""
    return [holder for listener in (GRPC_LISTENER, HTTP_LISTENER)
            for host in virtual_hosts(envoy, listener)
            for holder in [host, *(r["route"] for r in host.get("routes") or [] if "route" in r)]]


def sequence_tries(envoy: dict[str, Any]) -> dict[str, int | None]:
    """Per client listener, how many Tritons a call of a sequence may try at most (the fewest
    among its retry policies that retry Triton's refusal; None: none does, so such a call
    reaches one Triton only)."""
    found: dict[str, int | None] = {}
    for listener in (GRPC_LISTENER, HTTP_LISTENER):
        tries = [1 + int(policy.get("num_retries", 1))
                 for host in virtual_hosts(envoy, listener)
                 for policy in [host.get("retry_policy") or {}] + [
                     (r.get("route") or {}).get("retry_policy") or {}
                     for r in host.get("routes") or []]
                 if retries_sequences(policy)]
        found[listener] = min(tries) if tries else None
    return found


def _match_key(route: dict[str, Any]) -> str:
    match = route.get("match", {})
    return str(match.get("path") or (match.get("safe_regex") or {}).get("regex"))


def refusals(envoy: dict[str, Any], serve_config: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per route that the config refuses or allowed_admin_rpcs wants refused: whether
    the Serve config allows it, whether the config refuses it and, where both refuse it,
    whether with the forwarder's answer. The rule over them is in schema/invariants.schema.json."""
    allowed = allowed_admin_rpcs(serve_config)
    rows: list[dict[str, Any]] = []
    for listener, wanted_routes in ((GRPC_LISTENER, refused_routes(allowed)),
                                    (HTTP_LISTENER, refused_http_routes(allowed))):
        wanted = {_match_key(r): r for r in wanted_routes if "direct_response" in r}
        present = {_match_key(r): r for r in listener_routes(envoy, listener)
                   if "direct_response" in r}
        for path in sorted(set(wanted) | set(present)):
            row: dict[str, Any] = {"listener": listener, "path": path,
                                   "allowed": path not in wanted, "refused": path in present}
            if path in wanted and path in present:
                row["asForwarder"] = present[path] == wanted[path]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    text = ENVOY_CONFIG.read_text()
    serve_config = yaml.safe_load(SERVE_CONFIG.read_text())
    rendered = render(text, allowed_admin_rpcs(serve_config), sequence_retries(serve_config),
                      tries_per_priority(serve_config))
    return write_or_check(ENVOY_CONFIG, rendered, argv, __doc__, "make gateway-config")


if __name__ == "__main__":
    sys.exit(main())
