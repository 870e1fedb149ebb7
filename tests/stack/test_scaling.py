"""The Serve path's back-pressure and autoscaling, on a stack of its own with two simulated
pods: small limits refuse an overload quickly, and replicas follow Triton's queue time up and
down without losing a call (the same policy as the gateway's, test_gateway.py; its pre-warm
request is tested from zero pods in test_zero.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from local_stack.harness import RunningStack, processes_left_behind, running_stack, serve_config_with
from local_stack.triton_inputs import tensor
from tests.stack.test_gateway import AUTOSCALING
from tests.support.load import scale_cycle


@pytest.fixture(scope="module")
def serve_pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    config = serve_config_with(
        tmp_path_factory.mktemp("serve-config"),
        deployment={"max_ongoing_requests": 2, "max_queued_requests": 8,
                    "graceful_shutdown_timeout_s": 20, "health_check_period_s": 2},
        autoscaling={**AUTOSCALING, "min_replicas": 1, "max_replicas": 2})
    with running_stack({"DATA_PATH": "serve", "TRITONS": "2",
                        "SERVE_CONFIG": str(config)}) as running:
        yield running
    assert not processes_left_behind(running.process)


def _slow(seconds: float) -> list[tc.InferInput]:
    return [tensor("SECONDS", np.array([seconds], dtype=np.float32), "FP32")]


def test_overload_is_refused_quickly_not_queued_forever(serve_pods: RunningStack) -> None:
    url = serve_pods.url("GRPC_PORT")

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


def test_replicas_follow_tritons_queue_time_up_and_down(
    serve_pods: RunningStack, tmp_path: Path
) -> None:
    # Room in each replica for more calls than Triton runs at once, so they queue in Triton.
    serve_pods.redeploy(serve_config_with(
        tmp_path, deployment={"max_ongoing_requests": 16, "graceful_shutdown_timeout_s": 20,
                              "health_check_period_s": 2},
        autoscaling={**AUTOSCALING, "min_replicas": 1, "max_replicas": 2},
        policy_kwargs={"target_queue_ms_per_exec": 50}))
    timeline, outcomes = scale_cycle(serve_pods)
    counts = [count for _, count in timeline]
    assert [s for _, s, _ in outcomes if s != "OK"] == []
    assert counts[0] == 1 and max(counts) == 2, timeline
    assert counts[-1] == 1, f"never scaled back down: {timeline}"


def test_scaled_stack_still_answers(serve_pods: RunningStack) -> None:
    assert tc.InferenceServerClient(serve_pods.url("GRPC_PORT")).is_server_ready()
