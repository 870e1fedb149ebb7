"""Bad input and broken parts end every call with a clear status, never a hang: malformed and
random requests, oversized messages, a client cancelling a stream, a Serve replica killed under
load; and Triton's own port refuses admin RPCs without the forwarder's key."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from local_stack.polling import until
from local_stack.triton_inputs import simple_inputs
from tests.stack.conftest import MESSAGE_LIMIT, Stack
from tests.support.load import Outcome, load

INFER = "/inference.GRPCInferenceService/ModelInfer"


def _raw_call(url: str, payload: bytes) -> tuple[Any, str]:
    with grpc.insecure_channel(url, options=[("grpc.max_send_message_length", -1)]) as channel:
        try:
            channel.unary_unary(INFER)(payload, timeout=30)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            return error.code(), error.details()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=512))
def test_random_bytes_get_tritons_own_answer(stack: Stack, payload: bytes) -> None:
    assert _raw_call(stack.url, payload) == _raw_call(stack.triton_url, payload)


request_strategy = st.builds(
    service_pb2.ModelInferRequest,
    model_name=st.sampled_from(["simple", "identity_fp32", "repeat_int32", "nope", ""]),
    model_version=st.sampled_from(["", "1", "7"]),
    id=st.text(max_size=8),
    inputs=st.lists(st.builds(
        service_pb2.ModelInferRequest.InferInputTensor,
        name=st.sampled_from(["INPUT0", "INPUT1", "INPUT", "X"]),
        datatype=st.sampled_from(["INT32", "FP32", "BYTES", "BOOGUS"]),
        shape=st.lists(st.integers(-2, 20), max_size=3),
    ), max_size=3),
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=request_strategy)
def test_random_infer_requests_get_tritons_own_answer(
    stack: Stack, request: service_pb2.ModelInferRequest
) -> None:
    payload = request.SerializeToString()
    through, direct = _raw_call(stack.url, payload), _raw_call(stack.triton_url, payload)
    assert through == direct


def test_stack_still_serves_after_the_fuzzing(stack: Stack) -> None:
    assert tc.InferenceServerClient(stack.url).is_model_ready("simple")


def test_request_over_the_size_limit_is_refused_clearly(stack: Stack) -> None:
    if stack.data_path == "gateway":
        pytest.skip("the gateway sets no size limit of its own: Triton's (2 GiB) applies, and "
                    "test_forwarding's 256 MiB call passes")
    data = np.zeros((MESSAGE_LIMIT + (8 << 20)) // 4, dtype=np.float32)
    tensor = tc.InferInput("INPUT", [data.size], "FP32")
    tensor.set_data_from_numpy(data)
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as caught:
        tc.InferenceServerClient(stack.url).infer("identity_fp32", [tensor],
                                                        client_timeout=120)
    assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert re.search(r"larger than max \(\d+ vs\. \d+\)", caught.value.message())
    assert time.monotonic() - started < 60


def test_triton_port_refuses_admin_rpcs_without_the_forwarders_key(stack: Stack) -> None:
    client = tc.InferenceServerClient(stack.triton_url)
    calls: list[Callable[[], Any]] = [
        lambda: client.unload_model("simple"),
        lambda: client.load_model("simple"),
        lambda: client.register_system_shared_memory("r", "/k", 64),
    ]
    for call in calls:
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert "restricted" in caught.value.message().lower()
    assert client.is_model_ready("simple")


def test_client_cancelling_a_stream_cancels_it_in_triton(stack: Stack) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client = tc.InferenceServerClient(stack.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    count = tc.InferInput("COUNT", [1], "INT32")
    count.set_data_from_numpy(np.array([300], dtype=np.int32))
    client.async_stream_infer("stream_cancel", [count], request_id="cancel-1")
    for _ in range(3):
        _, error = responses.get(timeout=30)
        assert error is None
    client.stop_stream(cancel_requests=True)
    marker = stack.model_repository / "stream_cancel" / "cancelled" / "cancel-1"
    until("Triton to stop streaming after the client cancelled", marker.exists, 15,
          every_s=0.1)
    assert int(marker.read_text()) < 100


def _replica_pids() -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"ray::ServeReplica:triton:TritonPod"):
                pids.append(int(proc.name))
    return pids


# The load's longest run, and how long it goes on once a call passed again after the kill.
LOAD_MAX_S = 40
AFTER_RECOVERY_S = 3


@pytest.mark.disruptive
def test_serve_replica_killed_under_load(stack: Stack) -> None:
    """Every call ends within its deadline with an answer or a status; then Serve recovers."""
    if stack.data_path == "gateway":
        pytest.skip("on the gateway path no call passes a replica (test_gateway.py kills a "
                    "Triton and removes a pod instead)")
    async def kill_then_load() -> list[Outcome]:
        stop = asyncio.Event()
        task = asyncio.ensure_future(load(stack.url, LOAD_MAX_S, 8, stop=stop))
        await asyncio.sleep(3)
        (pid,) = _replica_pids()
        os.kill(pid, signal.SIGKILL)
        # The load goes on until a call passes again (Serve's new replica), then a while more.
        await asyncio.to_thread(until, "a call to pass after the kill", _one_call_passes,
                                LOAD_MAX_S, 0.5)
        await asyncio.sleep(AFTER_RECOVERY_S)
        stop.set()
        return await task

    def _one_call_passes() -> object:
        client = tc.InferenceServerClient(stack.url)
        try:
            ones = np.ones((1, 16), dtype=np.int32)
            client.infer("simple", simple_inputs(ones, ones), client_timeout=5)
            return True
        except InferenceServerException as error:
            return f"{error.status()}: {error.message()}"
        finally:
            client.close()

    outcomes = [(status, seconds) for _, status, seconds in asyncio.run(kill_then_load())]
    statuses = [status for status, _ in outcomes]
    print(f"replica killed: {len(outcomes)} calls, {statuses.count('OK')} ok, "
          f"{len(outcomes) - statuses.count('OK')} ended with a status "
          f"({sorted(set(statuses) - {'OK'})}), 0 hung; longest call "
          f"{max(elapsed for _, elapsed in outcomes):.1f}s")
    assert outcomes, "no call was made"
    # Nothing hung: every call ended before its 10 s deadline (plus scheduling slack).
    assert max(elapsed for _, elapsed in outcomes) < 12
    assert {status for status, _ in outcomes} <= {
        "OK", "StatusCode.UNAVAILABLE", "StatusCode.INTERNAL", "StatusCode.CANCELLED",
        "StatusCode.DEADLINE_EXCEEDED"}
    # Serve brought a replica back and calls succeed again by the end of the load.
    assert any(status == "OK" for status, _ in outcomes[-20:]), outcomes[-20:]
    assert len(_replica_pids()) == 1


def test_ray_refuses_calls_without_its_token(stack: Stack) -> None:
    """Ray's token authentication is on, as in the RayService (authOptions: token): the
    dashboard's job API (which runs code on the cluster) refuses a caller without it."""
    jobs = f"http://127.0.0.1:{stack.running.ports['RAY_DASHBOARD_PORT']}/api/jobs/"
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(urllib.request.Request(jobs, headers=headers), timeout=10)
        assert caught.value.code in (401, 403), headers
    with urllib.request.urlopen(urllib.request.Request(
            jobs, headers={"Authorization": f"Bearer {stack.running.ray_token}"}),
            timeout=10) as response:
        assert response.status == 200
    # ...while the stack serves: the token is Ray's, not the clients'.
    assert tc.InferenceServerClient(stack.url).is_server_ready()
