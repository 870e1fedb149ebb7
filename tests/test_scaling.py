"""Serve's back-pressure and autoscaling with the forwarder, on a stack of their own: the local
node advertises three `triton` resources and the Serve config has small limits and short
delays (tests/fixtures/serve-config-scaling.yaml)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from local_stack.harness import ROOT, processes_left_behind, running_stack
from tests.triton_inputs import tensor


@pytest.fixture(scope="module")
def scaling_stack() -> Iterator[dict[str, str]]:
    with running_stack({
        "TRITON_RESOURCES": "3",
        "SERVE_CONFIG": str(ROOT / "tests" / "fixtures" / "serve-config-scaling.yaml"),
    }) as running:
        yield running.ports
    assert not processes_left_behind(running.process)


def replica_states(ports: dict[str, str]) -> list[str]:
    url = f"http://127.0.0.1:{ports['RAY_DASHBOARD_PORT']}/api/serve/applications/"
    with urllib.request.urlopen(url, timeout=10) as response:
        details = json.load(response)
    deployment = details["applications"]["triton"]["deployments"]["TritonForwarder"]
    return [r["state"] for r in deployment["replicas"]]


def running_replicas(ports: dict[str, str]) -> int:
    return replica_states(ports).count("RUNNING")


def _slow(seconds: float) -> list[tc.InferInput]:
    return [tensor("SECONDS", np.array([seconds], dtype=np.float32), "FP32")]


def test_overload_is_refused_quickly_not_queued_forever(scaling_stack: dict[str, str]) -> None:
    url = f"localhost:{scaling_stack['GRPC_PORT']}"

    async def burst() -> list[tuple[str, float]]:
        client = tc_aio.InferenceServerClient(url)

        async def one() -> tuple[str, float]:
            started = time.monotonic()
            try:
                await client.infer("slow", _slow(3.0), client_timeout=60)
                return "OK", time.monotonic() - started
            except InferenceServerException as error:
                return str(error.status()), time.monotonic() - started

        try:
            return await asyncio.gather(*(one() for _ in range(40)))
        finally:
            await client.close()

    outcomes = asyncio.run(burst())
    refused = [elapsed for status, elapsed in outcomes if status == "StatusCode.RESOURCE_EXHAUSTED"]
    assert refused, outcomes
    assert max(refused) < 3.0, "a refusal waited as long as a call: it was queued"
    assert {status for status, _ in outcomes} <= {"OK", "StatusCode.RESOURCE_EXHAUSTED"}
    assert any(status == "OK" for status, _ in outcomes)


def test_replicas_follow_the_load_up_and_down_without_losing_a_call(
    scaling_stack: dict[str, str]
) -> None:
    url = f"localhost:{scaling_stack['GRPC_PORT']}"
    # The overload test may have scaled up: start from one replica, and none still draining
    # (direct-ingress replicas drain for at least 30 s, holding their `triton` resource).
    settle_by = time.monotonic() + 120
    while replica_states(scaling_stack) != ["RUNNING"]:
        assert time.monotonic() < settle_by, "never settled at one replica"
        time.sleep(1)
    timeline: list[tuple[float, int]] = []
    failures: list[str] = []
    calls = 0

    async def cycle() -> None:
        nonlocal calls
        client = tc_aio.InferenceServerClient(url)
        start = time.monotonic()
        stop_heavy = start + 25
        stop_all = start + 75

        async def worker(until: float, pause_s: float = 0.0) -> None:
            nonlocal calls
            while time.monotonic() < until:
                calls += 1
                try:
                    await client.infer("slow", _slow(0.3), client_timeout=60)
                except InferenceServerException as error:
                    failures.append(f"{error.status()}: {error.message()}")
                await asyncio.sleep(pause_s)

        async def watch() -> None:
            while time.monotonic() < stop_all:
                replicas = await asyncio.to_thread(running_replicas, scaling_stack)
                timeline.append((round(time.monotonic() - start, 1), replicas))
                await asyncio.sleep(1)

        try:
            # Four callers drive three replicas up; one caller keeps calls in flight while
            # the others stop and Serve drains replicas away, pausing between calls so that
            # its load (about half a call in flight) asks for one replica.
            await asyncio.gather(*(worker(stop_heavy) for _ in range(4)),
                                 worker(stop_all, pause_s=0.3), watch())
        finally:
            await client.close()

    asyncio.run(cycle())
    counts = [replicas for _, replicas in timeline]
    print("replicas over time (s, running):", timeline, "calls:", calls)
    assert failures == [], failures[:5]
    assert counts[0] == 1 and max(counts) == 3, timeline
    peak = counts.index(3)
    assert min(counts[peak:]) == 1, f"never scaled back down: {timeline}"
    assert calls > 100


def test_scaled_stack_still_answers(scaling_stack: dict[str, str]) -> None:
    client = tc.InferenceServerClient(f"localhost:{scaling_stack['GRPC_PORT']}")
    assert client.is_server_ready()
    assert running_replicas(scaling_stack) >= 1

