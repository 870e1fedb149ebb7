"""Triton's protocol through real Ray Serve to a real Triton, compared with Triton directly."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from local_stack.polling import until
from local_stack.triton_inputs import simple_inputs, tensor
from tests.stack.conftest import ADMIN_METADATA, Stack

GIB = 1 << 30


@pytest.fixture(scope="module")
def stubs(stack: Stack) -> Iterator[dict[str, service_pb2_grpc.GRPCInferenceServiceStub]]:
    options = [("grpc.max_send_message_length", GIB), ("grpc.max_receive_message_length", GIB)]
    channels = {"through": grpc.insecure_channel(stack.url, options=options),
                "triton": grpc.insecure_channel(stack.triton_url, options=options)}
    yield {name: service_pb2_grpc.GRPCInferenceServiceStub(ch) for name, ch in channels.items()}
    for channel in channels.values():
        channel.close()


def _infer_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="simple", id="same-id")
    for name in ("INPUT0", "INPUT1"):
        given = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        given.contents.int_contents.extend(range(16))
    return request


UNARY_CASES: list[tuple[str, Callable[[], Any]]] = [
    ("ServerLive", service_pb2.ServerLiveRequest),
    ("ServerReady", service_pb2.ServerReadyRequest),
    ("ModelReady", lambda: service_pb2.ModelReadyRequest(name="simple")),
    ("ServerMetadata", service_pb2.ServerMetadataRequest),
    ("ModelMetadata", lambda: service_pb2.ModelMetadataRequest(name="simple")),
    ("ModelConfig", lambda: service_pb2.ModelConfigRequest(name="repeat_int32")),
    ("ModelInfer", _infer_request),
    ("RepositoryIndex", service_pb2.RepositoryIndexRequest),
]


@pytest.mark.parametrize(("method", "make_request"), UNARY_CASES, ids=[c[0] for c in UNARY_CASES])
def test_unary_rpc_answers_as_triton_does(
    stubs: dict[str, Any], method: str, make_request: Callable[[], Any]
) -> None:
    # Triton's own port wants the key for the repository group, as the forwarder sends it.
    direct = getattr(stubs["triton"], method)(make_request(), timeout=30, metadata=ADMIN_METADATA)
    through = getattr(stubs["through"], method)(make_request(), timeout=30)
    assert through == direct
    assert direct.ByteSize() > 0 or method in ("ServerLive", "ServerReady")


def test_model_statistics_answer_as_triton_does(stubs: dict[str, Any]) -> None:
    request = service_pb2.ModelStatisticsRequest(name="simple")
    through = stubs["through"].ModelStatistics(request, timeout=30)
    direct = stubs["triton"].ModelStatistics(request, timeout=30)
    # Counters move between the two calls; the shape and the models must not differ.
    assert [(s.name, s.version) for s in through.model_stats] == [
        (s.name, s.version) for s in direct.model_stats
    ]
    assert through.model_stats[0].inference_count <= direct.model_stats[0].inference_count
    assert set(json_format.MessageToDict(through)) == set(json_format.MessageToDict(direct))


def test_tritonclient_infer_through_serve(stack: Stack) -> None:
    client = tc.InferenceServerClient(stack.url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    result = client.infer("simple", simple_inputs(a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_pass(stack: Stack, algorithm: str) -> None:
    client = tc.InferenceServerClient(stack.url)
    a = np.full((1, 16), 7, dtype=np.int32)
    result = client.infer("simple", simple_inputs(a, a), compression_algorithm=algorithm)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)


def test_decoupled_model_streams_every_response(stack: Stack) -> None:
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tc.InferenceServerClient(stack.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    count = 12
    inputs = [tc.InferInput("IN", [count], "INT32"), tc.InferInput("DELAY", [count], "UINT32"),
              tc.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(np.arange(100, 100 + count, dtype=np.int32))
    inputs[1].set_data_from_numpy(np.full(count, 20, dtype=np.uint32))
    inputs[2].set_data_from_numpy(np.array([0], dtype=np.uint32))
    try:
        client.async_stream_infer("repeat_int32", inputs, request_id="stream-1")
        client.async_stream_infer("repeat_int32", inputs, request_id="stream-2")
        got: dict[str, list[int]] = {"stream-1": [], "stream-2": []}
        for _ in range(2 * count):
            result, error = responses.get(timeout=30)
            assert error is None, error
            got[result.get_response().id].append(int(result.as_numpy("OUT")[0]))
    finally:
        client.stop_stream()
    assert got == {key: list(range(100, 100 + count)) for key in got}


def _error(url: str, call: Callable[[tc.InferenceServerClient], Any]) -> tuple[Any, str]:
    with pytest.raises(InferenceServerException) as caught:
        call(tc.InferenceServerClient(url))
    return caught.value.status(), caught.value.message()


BAD_CALLS: dict[str, Callable[[tc.InferenceServerClient], Any]] = {
    "unknown model": lambda c: c.infer("no_such_model", simple_inputs(
        np.zeros((1, 16), np.int32), np.zeros((1, 16), np.int32))),
    "unknown model metadata": lambda c: c.get_model_metadata("no_such_model"),
    "wrong shape": lambda c: c.infer("simple", simple_inputs(
        np.zeros((1, 15), np.int32), np.zeros((1, 15), np.int32))),
    "wrong dtype": lambda c: c.infer("simple", [
        tensor("INPUT0", np.zeros((1, 16), np.float32), "FP32"),
        tensor("INPUT1", np.zeros((1, 16), np.float32), "FP32")]),
    "missing input": lambda c: c.infer("simple", [
        tensor("INPUT0", np.zeros((1, 16), np.int32), "INT32")]),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_errors_reach_the_client_as_triton_gives_them(stack: Stack, case: str) -> None:
    direct = _error(stack.triton_url, BAD_CALLS[case])
    through = _error(stack.url, BAD_CALLS[case])
    assert through == direct
    assert direct[0] != "StatusCode.OK"


def test_malformed_request_bytes_get_triton_error(stack: Stack) -> None:
    def call(url: str) -> grpc.RpcError:
        with grpc.insecure_channel(url) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.RpcError) as caught:
                infer(b"\xff\xff\xff\xff not a protobuf", timeout=10)
            return caught.value

    direct, through = call(stack.triton_url), call(stack.url)
    assert (through.code(), through.details()) == (direct.code(), direct.details())


def test_client_metadata_reaches_triton(stack: Stack) -> None:
    client = tc.InferenceServerClient(stack.url)
    result = client.infer(
        "echo_headers", [tensor("INPUT", np.array([1], np.int32), "INT32")],
        headers={"x-sonic-job": "ttbar-2026", "x-sonic-site": "purdue"},
    )
    parameters = result.as_numpy("PARAMETERS")[0].decode()
    assert '"x-sonic-job":"ttbar-2026"' in parameters
    assert '"x-sonic-site":"purdue"' in parameters


def test_client_deadline_reaches_triton(stack: Stack) -> None:
    client = tc.InferenceServerClient(stack.url)
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("slow", [tensor("SECONDS", np.array([20], np.float32), "FP32")],
                     request_id="deadline-1", client_timeout=1.0)
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    marker = stack.model_repository / "slow" / "cancelled" / "deadline-1"
    until("Triton to see the request end at the client's deadline", marker.exists,
          10 - (time.monotonic() - started), every_s=0.1)
    assert float(marker.read_text()) < 5


def test_large_request_passes(stack: Stack) -> None:
    data = np.arange(64 << 20, dtype=np.float32)  # 256 MiB each way
    client = tc.InferenceServerClient(stack.url)
    result = client.infer("identity_fp32", [tensor("INPUT", data, "FP32")], client_timeout=300)
    output = result.as_numpy("OUTPUT")
    assert output.nbytes == 256 << 20
    assert np.array_equal(output, data)


def test_hundred_concurrent_clients_all_get_their_own_answer(stack: Stack) -> None:
    async def one_client(index: int) -> bool:
        client = tc_aio.InferenceServerClient(stack.url)
        try:
            ok = True
            for round_ in range(3):
                a = np.full((1, 16), index, dtype=np.int32)
                b = np.full((1, 16), round_, dtype=np.int32)
                inputs = [tensor("INPUT0", a, "INT32"), tensor("INPUT1", b, "INT32")]
                result = await client.infer("simple", inputs, client_timeout=120)
                ok &= bool(np.array_equal(result.as_numpy("OUTPUT0"), a + b))
            return ok
        finally:
            await client.close()

    async def all_clients() -> list[bool]:
        return await asyncio.gather(*(one_client(i) for i in range(100)))

    assert asyncio.run(all_clients()) == [True] * 100


REFUSED: dict[str, Callable[[tc.InferenceServerClient], Any]] = {
    "RepositoryModelLoad": lambda c: c.load_model("simple"),
    "RepositoryModelUnload": lambda c: c.unload_model("simple"),
    "SystemSharedMemoryRegister": lambda c: c.register_system_shared_memory("r", "/k", 64),
    "SystemSharedMemoryUnregister": lambda c: c.unregister_system_shared_memory(),
    "CudaSharedMemoryRegister": lambda c: c.register_cuda_shared_memory("r", b"\0" * 64, 0, 64),
    "CudaSharedMemoryUnregister": lambda c: c.unregister_cuda_shared_memory(),
    "TraceSetting": lambda c: c.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}),
    "LogSettings": lambda c: c.update_log_settings(settings={"log_verbose_level": 1}),
}


@pytest.mark.parametrize("rpc", list(REFUSED))
def test_load_balancer_hazards_are_refused_and_the_model_stays(stack: Stack, rpc: str) -> None:
    status, message = _error(stack.url, REFUSED[rpc])
    assert status == "StatusCode.PERMISSION_DENIED"
    assert message.startswith(f"{rpc} is refused by this endpoint")
    assert "allowed_admin_rpcs" in message
    assert tc.InferenceServerClient(stack.url).is_model_ready("simple")
