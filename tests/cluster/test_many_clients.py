"""Thousands of CMSSW jobs each hold a channel: 2,000 client connections through the Service IP,
each calling in a loop for 60 s (two of the gateway's keepalive pings), none refused or reset,
the gateway's memory under its limit. How fast is `make bench`'s to say, not this test's."""

from __future__ import annotations

import asyncio
import resource
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from local_stack.triton_inputs import simple_inputs
from tests.support.cluster import OWN_CONNECTION, Cluster, tcp_counters

CONNECTIONS = 2000
SECONDS = 60.0
# The gateway container's memory limit (gateway/gateway.yaml).
GATEWAY_MEMORY_LIMIT = 1 << 30


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def _many(url: str, envoy_pids: list[int]) -> tuple[list[float], list[str], int]:
    ones = np.ones((1, 16), dtype=np.int32)
    latencies: list[float] = []
    failures: list[str] = []
    peak = 0
    clients = [tc_aio.InferenceServerClient(url, channel_args=OWN_CONNECTION)
               for _ in range(CONNECTIONS)]
    end = time.monotonic() + SECONDS

    async def caller(client: tc_aio.InferenceServerClient) -> None:
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                await client.infer("simple", simple_inputs(ones, ones), client_timeout=30)
                latencies.append(time.monotonic() - started)
            except InferenceServerException as error:
                failures.append(f"{error.status()}: {error.message()}")

    async def watch() -> None:
        nonlocal peak
        while time.monotonic() < end:
            peak = max([peak, *(_rss(pid) for pid in envoy_pids)])
            await asyncio.sleep(1)

    try:
        await asyncio.gather(watch(), *(caller(c) for c in clients))
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    return latencies, failures, peak


def _summary(latencies: list[float]) -> str:
    cuts = statistics.quantiles(latencies, n=100)
    return (f"{len(latencies)} calls ({len(latencies) / SECONDS:.0f}/s), p50 "
            f"{cuts[49] * 1000:.1f} ms, p99 {cuts[98] * 1000:.1f} ms")


def test_two_thousand_connections_through_the_service_ip(cluster: Cluster) -> None:
    cluster.settled(3)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    envoys = [cluster.pid(gateway, "envoy") for gateway in cluster.ready_pods("gateway")]
    through, failed, peak = asyncio.run(_many(cluster.grpc_url, envoys))
    # Read before anything replaces a gateway pod: a failure must say how its calls ended.
    counters = "; ".join([*(cluster.connection_counters(g) for g in cluster.ready_pods("gateway")),
                          "this machine: " + ", ".join(tcp_counters())])
    print(f"{CONNECTIONS} connections for {SECONDS:.0f}s through the gateway: "
          f"{_summary(through)}, {len(failed)} failed; the gateway pods' peak RSS "
          f"{peak / 2**20:.0f} MiB")
    assert failed == [], (f"{len(failed)} calls failed through the gateway: "
                          f"{Counter(failed).most_common(5)}; {counters}")
    assert len(through) > CONNECTIONS  # every connection made calls
    assert peak < GATEWAY_MEMORY_LIMIT
