"""The Serve path's back-pressure and autoscaling, on a stack of its own with two simulated
pods: small limits refuse an overload quickly, replicas follow Triton's queue time up and
down without losing a call (the same policy as the gateway's, test_gateway.py), and an
operator's pre-warm request holds replicas until its time passes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from local_stack.harness import RunningStack, processes_left_behind, running_stack, serve_config_with
from local_stack.polling import until
from local_stack.ray_cluster import replicas
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
    with running_stack({"DATA_PATH": "serve", "TRITONS": "2", "OBSERVE": "1",
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


# How long the request holds: long enough for a replica to start on this machine, short for
# make test's budget (an operator asks for hours).
PREWARM_S = 75


def _running(stack: RunningStack) -> int:
    dashboard = f"http://127.0.0.1:{stack.ports['RAY_DASHBOARD_PORT']}"
    return sum(1 for r in replicas(dashboard, stack.ray_token) if r.get("state") == "RUNNING")


def _prewarm_gauge(stack: RunningStack) -> float | None:
    query = urllib.parse.urlencode({"query": "max (ray_sonic_ray_prewarm_pods)"})
    with urllib.request.urlopen(f"http://{stack.url('PROMETHEUS_PORT')}/api/v1/query?{query}",
                                timeout=10) as response:
        result = json.load(response)["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_a_prewarm_request_holds_its_pods_until_its_time_then_lets_go(
        serve_pods: RunningStack) -> None:
    until("one replica while idle", lambda: _running(serve_pods) == 1 or
          f"{_running(serve_pods)} running", 120, every_s=1)
    ends = datetime.now(UTC) + timedelta(seconds=PREWARM_S)
    env = serve_pods.process.env
    # The operator's command, on the stack's pre-warm directory and its Serve config's bounds.
    done = subprocess.run(["make", "-s", "prewarm", "PODS=2", f"UNTIL={ends.isoformat()}",
                           f"DIR={env['PREWARM_DIR']}", f"SERVE_CONFIG={env['SERVE_CONFIG']}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # No call is made: the request alone starts the second replica, before its time passes.
    until("two replicas running, the dashboard's pre-warm floor at 2",
          lambda: datetime.now(UTC) >= ends or (_running(serve_pods), _prewarm_gauge(
              serve_pods)) == (2, 2.0) or f"{_running(serve_pods)} running, gauge "
          f"{_prewarm_gauge(serve_pods)}", PREWARM_S, every_s=1)
    assert datetime.now(UTC) < ends, "the second replica came only after the request's time"
    until("back to one replica once the request's time passed, the floor at 0",
          lambda: (datetime.now(UTC) > ends and (_running(serve_pods), _prewarm_gauge(
              serve_pods)) == (1, 0.0)) or f"{_running(serve_pods)} running, gauge "
          f"{_prewarm_gauge(serve_pods)}", PREWARM_S + 120, every_s=1)


def test_scaled_stack_still_answers(serve_pods: RunningStack) -> None:
    assert tc.InferenceServerClient(serve_pods.url("GRPC_PORT")).is_server_ready()
