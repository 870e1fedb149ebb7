"""Admission on the gateway path (docs/admission.md), on a stack of its own: two simulated pods
(TRITONS=2) at max_replicas, the queue-bounded `queue_limited` model (tests/models), and site
settings in the environment as the `admission` ConfigMap gives them (gateway/admission.env):
a saturated facility refuses calls beyond Triton's queue at once with RESOURCE_EXHAUSTED and a
retry hint, keeps the admitted calls fast, and turns new jobs away at RepositoryIndex (the
start-of-job gate) while saturated, while no Triton is ready, and, by this site's rule, while
the control plane's answer is stale."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as tc_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from local_stack.harness import RunningStack, processes_left_behind, running_stack, serve_config_with
from local_stack.polling import until
from tests.stack.test_gateway import AUTOSCALING
from tests.support.sockets import listening_pid

MODEL = "queue_limited"
# One execution (a batch of up to 4) takes this long: 2 Tritons serve 2 x 4 / 0.2 = 40 calls/s.
EXEC_S = 0.2
CAPACITY_PER_S = 2 * 4 / EXEC_S
SATURATED_QUEUE_MS = 150
STALE_S = 3
RETRY_AFTER_S = 1
# How soon the gate opens again once the load is gone: Serve's look-back (2 s here) and
# metrics interval, the policy's next loop, the gateway's next question (1 s).
REOPEN_S = 15
DEADLINE_S = 10.0
# An admitted call waits behind the batch executing, the batch Triton's batcher already holds
# and a queue of one batch: about four executions, measured 3.6x the unloaded p99 here.
ADMITTED_P99_BOUND = 5
# Refusals take ~5 ms; the slowest of thousands meets a pause of this 2-core machine.
REFUSED_P99_S = 0.05
REFUSED_MAX_S = 0.25


@pytest.fixture(scope="module")
def saturable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    config = serve_config_with(
        tmp_path_factory.mktemp("serve-config"),
        deployment={"health_check_period_s": 2},
        autoscaling={**AUTOSCALING, "min_replicas": 2, "max_replicas": 2},
        policy_kwargs={"target_queue_ms_per_exec": 50})
    with running_stack({"DATA_PATH": "gateway", "TRITONS": "2", "SERVE_CONFIG": str(config),
                        "SONIC_RAY_SATURATED_QUEUE_MS": str(SATURATED_QUEUE_MS),
                        "SONIC_RAY_GATE_WHEN_STALE": "closed",
                        "SONIC_RAY_GATE_STALE_S": str(STALE_S),
                        "SONIC_RAY_RETRY_AFTER_S": str(RETRY_AFTER_S)},
                       ready_pattern=r"gateway discovery: pods \[0, 1\]") as running:
        yield running
    assert running.process.process.returncode == 0
    assert not processes_left_behind(running.process)


def _request(seconds: float) -> service_pb2.ModelInferRequest:
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name="SECONDS", datatype="FP32",
                                                            shape=[1, 1])
    return service_pb2.ModelInferRequest(
        model_name=MODEL, inputs=[tensor],
        raw_input_contents=[np.array([[seconds]], dtype=np.float32).tobytes()])


async def _infer(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> tuple[str, float, dict[str, str]]:
    started = time.monotonic()
    try:
        await stub.ModelInfer(_request(EXEC_S), timeout=DEADLINE_S)
        return "OK", time.monotonic() - started, {}
    except grpc.aio.AioRpcError as error:
        trailers = {k: str(v) for k, v in (error.trailing_metadata() or ())}
        return error.code().name, time.monotonic() - started, trailers


async def _job_start(client: tc_aio.InferenceServerClient) -> tuple[str, float, str]:
    started = time.monotonic()
    try:
        await client.get_model_repository_index()
        return "OK", time.monotonic() - started, ""
    except InferenceServerException as error:
        return str(error.status()), time.monotonic() - started, str(error.message())


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def _gate_is(url: str, status: str) -> bool | tuple[str, float, str]:
    """True once RepositoryIndex gets `status` ("OK" or a gRPC status), else the answer."""
    answer = _gate_answer(url)
    return True if answer[0] == status else answer


def _gate_answer(url: str) -> tuple[str, float, str]:
    async def ask() -> tuple[str, float, str]:
        client = tc_aio.InferenceServerClient(url)
        try:
            return await _job_start(client)
        finally:
            await client.close()

    return asyncio.run(ask())


def test_twice_the_capacity_is_refused_at_once_and_closes_the_gate(saturable: RunningStack) -> None:
    url = saturable.url("GRPC_PORT")

    async def run() -> tuple[list[float], list[tuple[str, float, dict[str, str]]],
                             list[tuple[float, str, float, str]]]:
        async with grpc.aio.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            unloaded = []
            for _ in range(20):
                status, took, _ = await _infer(stub)
                assert status == "OK"
                unloaded.append(took)
            client = tc_aio.InferenceServerClient(url)
            gate: list[tuple[float, str, float, str]] = []
            start = time.monotonic()

            async def watch_gate() -> None:
                while time.monotonic() - start < 60:
                    gate.append((time.monotonic() - start, *await _job_start(client)))
                    await asyncio.sleep(0.5)

            watcher = asyncio.create_task(watch_gate())
            # Open-loop arrivals at twice what the Tritons serve, for 60 s.
            calls = []
            interval = 1.0 / (2 * CAPACITY_PER_S)
            for i in range(int(60 / interval)):
                delay = start + i * interval - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                calls.append(asyncio.create_task(_infer(stub)))
            outcomes = await asyncio.gather(*calls)
            await watcher
            await client.close()
            return unloaded, list(outcomes), gate

    unloaded, outcomes, gate = asyncio.run(run())
    admitted = [took for status, took, _ in outcomes if status == "OK"]
    refused = [(took, trailers) for status, took, trailers in outcomes
               if status == "RESOURCE_EXHAUSTED"]
    others = sorted({status for status, _, _ in outcomes} - {"OK", "RESOURCE_EXHAUSTED"})
    print(f"2x capacity for 60 s: {len(outcomes)} calls, {len(admitted)} admitted "
          f"({len(admitted) / 60:.1f}/s, p99 {_p99(admitted) * 1000:.0f} ms; unloaded p99 "
          f"{_p99(unloaded) * 1000:.0f} ms), {len(refused)} refused (p99 "
          f"{_p99([t for t, _ in refused]) * 1000:.1f} ms, slowest "
          f"{max(t for t, _ in refused) * 1000:.1f} ms)")
    assert others == [], f"calls ended otherwise: {others}"
    assert refused and admitted
    assert _p99([took for took, _ in refused]) < REFUSED_P99_S
    assert max(took for took, _ in refused) < REFUSED_MAX_S
    hints = {trailers.get("grpc-retry-pushback-ms") for _, trailers in refused}
    assert hints == {str(RETRY_AFTER_S * 1000)}, hints
    # The start-of-job gate closed while saturated, and answered at once.
    closed = [(at, took, message) for at, status, took, message in gate
              if status == "StatusCode.CANCELLED"]
    print(f"gate closed {len(closed)} of {len(gate)} times asked, first at "
          f"{closed[0][0] if closed else None} s")
    assert closed, f"the gate never closed: {gate}"
    assert all(took < 0.05 for _, took, _ in closed), closed
    assert all("saturated" in message for _, _, message in closed), closed
    # Open again once the load is gone.
    gone = time.monotonic()
    until("the gate to open", lambda: _gate_is(url, "OK"),
          REOPEN_S)
    print(f"gate open again {time.monotonic() - gone:.1f} s after the load")
    # What Triton's queue policy bounds (docs/admission.md); without it the wait would grow
    # to the deadline.
    assert _p99(admitted) <= ADMITTED_P99_BOUND * _p99(unloaded)


def test_http_beyond_the_queue_gets_429_with_retry_after(saturable: RunningStack) -> None:
    url = f"http://{saturable.url('HTTP_PORT')}/v2/models/{MODEL}/infer"
    body = json.dumps({"inputs": [{"name": "SECONDS", "shape": [1, 1], "datatype": "FP32",
                                   "data": [EXEC_S]}]}).encode()

    def one(_: int) -> tuple[int, str | None, str]:
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
                return response.status, None, ""
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("retry-after"), error.read().decode()

    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(one, range(30)))
    codes = sorted({code for code, _, _ in answers})
    assert codes == [200, 429], answers
    for code, retry_after, text in answers:
        if code == 429:
            assert retry_after == str(RETRY_AFTER_S)
            assert "Exceeds maximum queue size" in json.loads(text)["error"]


def test_no_triton_ready_closes_the_gate_and_one_ready_opens_it(saturable: RunningStack) -> None:
    url = saturable.url("GRPC_PORT")
    pids = [saturable.process.triton_pid(pod) for pod in (0, 1)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        until("the gate to close", lambda: _gate_is(url, "StatusCode.CANCELLED"), 15)
        status, took, message = _gate_answer(url)
        assert status == "StatusCode.CANCELLED" and took < 0.05, (status, took)
        assert "no Triton is ready" in message
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    until("the gate to open", lambda: _gate_is(url, "OK"), 15)


def test_stale_signal_closes_the_gate_by_this_sites_rule(saturable: RunningStack) -> None:
    """SONIC_RAY_GATE_WHEN_STALE=closed here: with the control plane's answer gone (the Serve
    controller that serves it stopped), new jobs are turned away after SONIC_RAY_GATE_STALE_S."""
    url = saturable.url("GRPC_PORT")
    controller = listening_pid(int(saturable.ports["ADMISSION_PORT"]))
    os.kill(controller, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        until("the gate to close", lambda: _gate_is(url, "StatusCode.CANCELLED"), 15)
        waited = time.monotonic() - stopped
        status, took, message = _gate_answer(url)
        assert status == "StatusCode.CANCELLED", status
        assert "missing or older than" in message
        # Never before the answer it had went stale (os.time()'s whole seconds aside).
        assert waited >= STALE_S - 1, waited
        assert took < 0.25, took  # at most one unanswered question (100 ms) on the way
    finally:
        os.kill(controller, signal.SIGCONT)
    until("the gate to open", lambda: _gate_is(url, "OK"), 15)
