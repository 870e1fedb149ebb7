"""The load signal Serve's autoscaler gets from each replica's own Triton: milliseconds a
request waited in Triton's queue per model execution over the last interval (SuperSONIC's
signal: `rate(nv_inference_queue_duration_us) / rate(nv_inference_exec_count)`).

Why this signal: on a GPU the queue is where overload shows first. Requests in flight grow
with the client's concurrency whether or not the GPU keeps up, and pending requests are a
snapshot; queue time per execution rises exactly when the dynamic batcher cannot start
batches as fast as they arrive, and it stays near zero while the GPU has room.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

QUEUE_METRIC = "queue_ms_per_exec"
_SAMPLE = re.compile(r"^(nv_inference_queue_duration_us|nv_inference_exec_count|"
                     r"nv_inference_pending_request_count)(?:\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class Counters:
    queue_us: float = 0.0
    executions: float = 0.0
    pending: float = 0.0


def parse(text: str) -> Counters:
    """Sums Triton's counters over every model and version."""
    sums = {"nv_inference_queue_duration_us": 0.0, "nv_inference_exec_count": 0.0,
            "nv_inference_pending_request_count": 0.0}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            sums[match.group(1)] += float(match.group(2))
    return Counters(sums["nv_inference_queue_duration_us"], sums["nv_inference_exec_count"],
                    sums["nv_inference_pending_request_count"])


def scrape(url: str, timeout_s: float) -> Counters:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse(response.read().decode())


class QueueTime:
    """Turns successive scrapes into queue milliseconds per execution since the last one."""

    def __init__(self) -> None:
        self._last: Counters | None = None
        self._value = 0.0

    def update(self, now: Counters) -> float:
        last, self._last = self._last, now
        if last is None or now.executions < last.executions:  # first scrape, or Triton restarted
            self._value = 0.0
            return self._value
        executions = now.executions - last.executions
        if executions > 0:
            self._value = (now.queue_us - last.queue_us) / 1000.0 / executions
        elif now.pending == 0:
            self._value = 0.0
        # Requests waiting but none executed in the interval: the last value still holds.
        return self._value
