"""Who called, as the gateway records it: its access log (one JSON line per call) and its
per-tenant counters on the metrics port (gateway/envoy.yaml, `access_log`). What the credential
tests compare with the calls they made."""

from __future__ import annotations

import collections
import datetime
import json
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from local_stack.polling import until

# The counters (the duration histogram's _count and _sum lag: Envoy merges histograms every
# few seconds); failures carry Envoy's response flags too.
_COUNTER = re.compile(r'^envoy_sonic_ray_tenant_(calls|failures|bytes_received|bytes_sent)'
                      r'\{tenant="([^"]*)",protocol="([^"]*)"(?:,flags="([^"]*)")?\} (\d+)$', re.M)


def _scrape(metrics_port: str) -> str:
    url = f"http://localhost:{metrics_port}/stats/prometheus"
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
    return text


def tenant_counters(metrics_port: str) -> collections.Counter[tuple[str, str, str]]:
    """(counter, tenant, protocol) -> value, for calls, failures (whatever their flags),
    bytes_received, bytes_sent."""
    found: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for name, tenant, protocol, _, value in _COUNTER.findall(_scrape(metrics_port)):
        found[name, tenant, protocol] += int(value)
    return found


def failures_by_flags(metrics_port: str) -> collections.Counter[tuple[str, str]]:
    """(tenant, Envoy's response flags) -> failures: RL over a share, UH no Triton ready."""
    found: collections.Counter[tuple[str, str]] = collections.Counter()
    for name, tenant, _, flags, value in _COUNTER.findall(_scrape(metrics_port)):
        if name == "failures":
            found[tenant, flags] += int(value)
    return found


def access_log_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _started(line: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(line["time"].replace("Z", "+00:00")).timestamp()


def _written_since(path: Path, since: float) -> list[dict[str, Any]]:
    """The access log's lines, as written out so far, of calls started at or after `since`
    (time.time(); the log's times are whole milliseconds)."""
    since = int(since * 1000) / 1000
    return [line for line in access_log_lines(path) if _started(line) >= since]


def a_line_since(path: Path, since: float, wanted: Callable[[dict[str, Any]], bool],
                 timeout_s: float) -> None:
    """Returns once the access log has a line `wanted` of a call started at or after `since`
    (time.time())."""
    until(f"such an access-log line in {path}",
          lambda: any(wanted(line) for line in _written_since(path, since)) or "none yet",
          timeout_s)


def lines_since(path: Path, since: float, count: int) -> list[dict[str, Any]]:
    """The access log's lines of calls started at or after `since` (time.time()), once there
    are `count` of them: Envoy writes its log out every second (gateway/start.sh)."""
    found: list[dict[str, Any]] = []

    def enough() -> bool | str:
        found[:] = _written_since(path, since)
        return len(found) >= count or f"{len(found)} of {count} lines"
    until(f"{count} access-log lines in {path}", enough, timeout_s=30)
    return found


def counters_after(metrics_port: str, before: collections.Counter[tuple[str, str, str]],
                   expected: dict[tuple[str, str, str], int]) -> collections.Counter[
                       tuple[str, str, str]]:
    """What the counters grew by since `before`, once they grew by `expected` at least (Envoy
    counts a call when its stream is done, a moment after the client has the answer)."""
    def grown() -> collections.Counter[tuple[str, str, str]]:
        now = tenant_counters(metrics_port)
        now.subtract(before)
        return collections.Counter({key: value for key, value in now.items() if value})

    until("the per-tenant counters to count the calls",
          lambda: all(grown()[key] >= value for key, value in expected.items()) or grown(),
          timeout_s=30)
    return grown()
