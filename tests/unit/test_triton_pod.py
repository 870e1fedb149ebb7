"""The forwarder's own code against an in-process gRPC server standing in for Triton: the
status, details and trailing metadata that Triton sends, and the deadline hand-over that
Serve's proxy context does not carry. Everything else runs against the real Triton."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from aiohttp import web
from ray.serve._private.grpc_util import gRPCGenericServer
from ray.serve._private.proxy_request_response import gRPCStreamingType

from local_stack.ports import free_ports
from triton_pod.grpc_forwarding import StreamEndedError
from triton_pod.pod import TritonPod, TritonPodArgs
from triton_pod.rpcs import BY_NAME
from triton_pod.servicer import TIMEOUT_KEY, add_triton_servicer
from triton_pod.warmup import WarmupArgs

READY = b"\x08\x01"


async def started_forwarder(args: TritonPodArgs) -> TritonPod:
    """A forwarder constructed as Serve does it: the async constructor awaited; its pod's
    readiness on a free port, its Triton's HTTP endpoint one that answers ready alone, and
    no warm-up (the stand-in Triton has no other HTTP API)."""
    ready_port, http_port, holding, holding_grpc = free_ports(4)
    await _http_triton(http_port, {})
    args = args.model_copy(update={"ready_port": ready_port, "holding_port": holding,
                                   "holding_grpc_port": holding_grpc,
                                   "triton_http_address": f"127.0.0.1:{http_port}",
                                   "warmup": WarmupArgs(enabled=False)})
    forwarder = TritonPod.__new__(TritonPod)
    await TritonPod.__init__(forwarder, args)
    return forwarder


async def _http_triton(port: int, routes: dict[tuple[str, str], Any],
                       asked: list[str] | None = None) -> web.AppRunner:
    """A stand-in for Triton's HTTP endpoint on `port`: /v2/health/ready, and `routes`
    ({(method, path): JSON answer}), each asked path appended to `asked`; it runs until the
    test's event loop ends."""
    app = web.Application()

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="")

    app.router.add_get("/v2/health/ready", ready)
    for (method, path), answer in routes.items():
        async def handler(request: web.Request, answer: Any = answer) -> web.Response:
            await request.read()
            if asked is not None:
                asked.append(request.path)
            return web.json_response(answer)

        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


class FakeContext:
    """Stands in for Serve's RayServegRPCContext: the same methods the forwarder uses."""

    def __init__(self, metadata: list[tuple[str, Any]]) -> None:
        self._metadata = metadata
        self.code: Any = None
        self.details = ""
        self.trailing: list[tuple[str, Any]] = []

    def invocation_metadata(self) -> list[tuple[str, Any]]:
        return self._metadata

    def set_code(self, code: Any) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: list[tuple[str, Any]]) -> None:
        self.trailing = metadata


@contextlib.asynccontextmanager
async def _running_fake_triton(
    seen: list[Any], extra: dict[str, grpc.RpcMethodHandler] | None = None
) -> AsyncIterator[int]:
    """The stand-in Triton's port while it runs."""
    server, port = await _fake_triton(seen, extra)
    try:
        yield port
    finally:
        await server.stop(None)


async def _fake_triton(
    seen: list[Any], extra: dict[str, grpc.RpcMethodHandler] | None = None
) -> tuple[grpc.aio.Server, int]:
    """A stand-in Triton: ServerReady/Live, ModelInfer and ModelStreamInfer, plus `extra`."""

    async def ready(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return READY

    async def infer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        seen.append((request, dict(context.invocation_metadata()), context.time_remaining()))
        context.set_trailing_metadata((("triton-trailer", "kept"), ("x-bin", b"\x00\x01")))
        if request == b"fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Triton says no")
        return b"reply:" + request

    async def stream(requests: AsyncIterator[bytes],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for request in requests:
            if request == b"fail":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Triton's stream gives up")
            yield b"echo:" + request
        context.set_trailing_metadata((("stream-trailer", "kept"),))

    handlers = {
        "ServerReady": grpc.unary_unary_rpc_method_handler(ready),
        "ServerLive": grpc.unary_unary_rpc_method_handler(ready),
        "ModelInfer": grpc.unary_unary_rpc_method_handler(infer),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream),
        **(extra or {}),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def test_status_details_and_trailers_pass_unchanged() -> None:
    async def scenario() -> None:
        seen: list[Any] = []
        async with _running_fake_triton(seen) as port:
            forwarder = await started_forwarder(TritonPodArgs(triton_address=f"127.0.0.1:{port}"))
            ok = FakeContext([("x-job", "1"), ("application", "triton"), (TIMEOUT_KEY, "7.5")])
            reply = await forwarder.forward_unary(BY_NAME["ModelInfer"], b"abc", ok)
            assert reply.SerializeToString() == b"reply:abc"
            assert ok.code is None
            assert ok.trailing == [("triton-trailer", "kept"), ("x-bin", b"\x00\x01")]
            _, metadata, remaining = seen[-1]
            assert metadata["x-job"] == "1"
            assert "application" not in metadata and TIMEOUT_KEY not in metadata
            assert 6.0 < remaining < 7.6  # gRPC rounds deadlines up

            failed = FakeContext([])
            await forwarder.forward_unary(BY_NAME["ModelInfer"], b"fail", failed)
            assert (failed.code, failed.details) == (
                grpc.StatusCode.INVALID_ARGUMENT, "Triton says no")
            assert ("triton-trailer", "kept") in failed.trailing
            assert seen[-1][2] is None  # no client deadline, none invented

            async def requests() -> AsyncIterator[bytes]:
                for item in (b"1", b"2", b"3"):
                    yield item

            streamed = FakeContext([])
            replies = [m.SerializeToString() async for m in forwarder.forward_stream(
                BY_NAME["ModelStreamInfer"], requests(), streamed)]
            assert replies == [b"echo:1", b"echo:2", b"echo:3"]
            assert streamed.trailing == [("stream-trailer", "kept")]

            # A stream that Triton ends with an error ends with an exception that carries the
            # code on the context: a status set after the last message would reach the client
            # as OK through Serve's classic proxy.
            async def failing() -> AsyncIterator[bytes]:
                for item in (b"1", b"fail"):
                    yield item

            broken = FakeContext([])
            got: list[bytes] = []
            with pytest.raises(StreamEndedError, match="Triton's stream gives up"):
                async for message in forwarder.forward_stream(
                        BY_NAME["ModelStreamInfer"], failing(), broken):
                    got.append(message.SerializeToString())
            assert got == [b"echo:1"]
            assert (broken.code, broken.details) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED, "Triton's stream gives up")

    asyncio.run(scenario())


def test_refused_rpc_never_reaches_triton_unless_allowed() -> None:
    async def scenario() -> None:
        seen: list[Any] = []
        async with _running_fake_triton(seen) as port:
            forwarder = await started_forwarder(TritonPodArgs(triton_address=f"127.0.0.1:{port}"))
            context = FakeContext([])
            await forwarder.forward_unary(BY_NAME["RepositoryModelLoad"], b"", context)
            assert context.code == grpc.StatusCode.PERMISSION_DENIED
            assert "allowed_admin_rpcs" in context.details

            allowed = await started_forwarder(TritonPodArgs(
                triton_address=f"127.0.0.1:{port}", allowed_admin_rpcs=["RepositoryModelLoad"]))
            context = FakeContext([])
            await allowed.forward_unary(BY_NAME["RepositoryModelLoad"], b"", context)
            # The fake Triton has no such method: the call went through to it.
            assert context.code == grpc.StatusCode.UNIMPLEMENTED

    asyncio.run(scenario())


def test_replica_waits_for_triton_and_gives_up_with_a_clear_error() -> None:
    async def scenario() -> None:
        with pytest.raises(TimeoutError, match=r"127\.0\.0\.1:9 was not ready within 1s"):
            await started_forwarder(
                TritonPodArgs(triton_address="127.0.0.1:9", ready_timeout_s=1))

    asyncio.run(scenario())


def test_servicer_hands_the_client_deadline_to_the_replica() -> None:
    async def scenario() -> None:
        seen: list[Any] = []

        def factory(service_method: str, streaming_type: gRPCStreamingType) -> Any:
            async def unary(request: bytes, context: Any) -> bytes:
                seen.append((service_method, request, dict(context.invocation_metadata())))
                return b"\x08\x01"

            async def streaming(requests: Any, context: Any) -> AsyncIterator[bytes]:
                seen.append((service_method, None, dict(context.invocation_metadata())))
                yield b""

            if streaming_type in (gRPCStreamingType.UNARY_UNARY, gRPCStreamingType.STREAM_UNARY):
                return unary
            return streaming

        server = gRPCGenericServer(factory)
        add_triton_servicer(None, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                ready = channel.unary_unary("/inference.GRPCInferenceService/ServerReady")
                assert await ready(b"raw", timeout=30, metadata=(("x-job", "7"),)) == b"\x08\x01"
                assert await ready(b"raw") == b"\x08\x01"
        finally:
            await server.stop(None)
        (method, request, metadata), (_, _, no_deadline) = seen
        assert method == "/inference.GRPCInferenceService/ServerReady"
        assert request == b"raw"  # bytes, never a parsed message
        assert metadata["x-job"] == "7"
        assert 25 < float(metadata[TIMEOUT_KEY]) < 30.1
        assert TIMEOUT_KEY not in no_deadline

    asyncio.run(scenario())


def test_bearer_tokens_let_in_only_their_holders(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# one token a line\ns3cret-analysis-token\n\nsecond-token\n")
    monkeypatch.setenv("SONIC_RAY_AUTH_TOKENS_FILE", str(tokens))

    async def scenario() -> None:
        seen: list[Any] = []
        async with _running_fake_triton(seen) as port:
            forwarder = await started_forwarder(TritonPodArgs(triton_address=f"127.0.0.1:{port}"))
            for presented in ([], [("authorization", "Bearer wrong")],
                              [("authorization", "s3cret-analysis-token")]):
                denied = FakeContext(list(presented))
                await forwarder.forward_unary(BY_NAME["ModelInfer"], b"x", denied)
                assert denied.code == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in denied.details
            assert seen == []  # nothing unauthenticated reached Triton
            ok = FakeContext([("authorization", "Bearer second-token"), ("x-job", "1")])
            reply = await forwarder.forward_unary(BY_NAME["ModelInfer"], b"x", ok)
            assert (ok.code, reply.SerializeToString()) == (None, b"reply:x")
            assert "authorization" not in seen[-1][1] and seen[-1][1]["x-job"] == "1"
            # A rotated Secret takes effect without a restart.
            tokens.write_text("rotated-token\n")
            os.utime(tokens, (time.time() + 10, time.time() + 10))
            monkeypatch.setattr("triton_pod.access._RECHECK_S", 0.0)
            old = FakeContext([("authorization", "Bearer second-token")])
            await forwarder.forward_unary(BY_NAME["ModelInfer"], b"x", old)
            assert old.code == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(scenario())
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert "s3cret-analysis-token" not in logged and "second-token" not in logged


def test_token_auth_without_a_readable_file_refuses_to_start(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SONIC_RAY_AUTH_TOKENS_FILE", str(tmp_path / "missing"))

    async def scenario() -> None:
        with pytest.raises(RuntimeError, match="cannot be read"):
            await started_forwarder(TritonPodArgs(triton_address="127.0.0.1:9"))

    asyncio.run(scenario())


def test_allowed_admin_rpc_carries_the_admin_key_and_clients_cannot_forge_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SONIC_RAY_ADMIN_KEY", "pod-uid-1234")
    seen_headers: list[dict[str, Any]] = []
    seen: list[Any] = []

    async def scenario() -> None:
        async def load(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            seen_headers.append(dict(context.invocation_metadata()))
            return b""

        async with _running_fake_triton(
                seen, {"RepositoryModelLoad": grpc.unary_unary_rpc_method_handler(load)}) as port:
            forwarder = await started_forwarder(TritonPodArgs(
                triton_address=f"127.0.0.1:{port}", allowed_admin_rpcs=["RepositoryModelLoad"]))
            forged = [("triton-grpc-protocol-sonic-ray-admin", "guessed")]
            await forwarder.forward_unary(BY_NAME["RepositoryModelLoad"], b"", FakeContext(forged))
            await forwarder.forward_unary(BY_NAME["ModelInfer"], b"", FakeContext(forged))

    asyncio.run(scenario())
    (admin,), infer = seen_headers, seen[-1][1]
    assert admin["triton-grpc-protocol-sonic-ray-admin"] == "pod-uid-1234"
    assert "triton-grpc-protocol-sonic-ray-admin" not in infer


def test_health_check_fails_once_triton_is_gone() -> None:
    """Serve's check_health: a dead Triton makes the replica unhealthy (Serve replaces it)."""

    async def scenario() -> None:
        server, port = await _fake_triton([])
        forwarder = await started_forwarder(
            TritonPodArgs(triton_address=f"127.0.0.1:{port}", health_timeout_s=2))
        await forwarder.check_health()
        await server.stop(None)
        with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:\d+ is not live: UNAVAILABLE"):
            await forwarder.check_health()

    asyncio.run(scenario())


def test_the_warm_up_waits_for_tritons_http_endpoint_which_starts_after_its_grpc_one() -> None:
    """Triton starts its gRPC endpoint a moment before its HTTP one. Seen in a CI rehearsal: the
    replica found Triton ready over gRPC, asked its ready models over HTTP 3 ms later, was
    refused the connection, and the pod joined with every model cold."""
    config = {"name": "m", "max_batch_size": 0,
              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}]}
    routes = {("POST", "/v2/repository/index"): [{"name": "m", "state": "READY"}],
              ("GET", "/v2/models/m/config"): config, ("POST", "/v2/models/m/infer"): {}}

    async def scenario() -> dict[str | None, float]:
        ready_port, http_port, holding, holding_grpc = free_ports(4)
        http_started: list[asyncio.Task[web.AppRunner]] = []

        async def ready(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if not http_started:  # HTTP comes up a moment after gRPC answers ready
                http_started.append(asyncio.get_running_loop().create_task(
                    _after(0.3, _http_triton(http_port, routes))))
            return READY

        async with _running_fake_triton([], {"ServerReady": grpc.unary_unary_rpc_method_handler(
                ready)}) as port:
            forwarder = TritonPod.__new__(TritonPod)
            await TritonPod.__init__(forwarder, TritonPodArgs(
                triton_address=f"127.0.0.1:{port}", triton_http_address=f"127.0.0.1:{http_port}",
                ready_port=ready_port, holding_port=holding, holding_grpc_port=holding_grpc,
                ready_timeout_s=30))
            return dict(forwarder._gauges)

    gauges = asyncio.run(scenario())
    assert "m" in gauges, f"the pod joined without warming its model: {gauges}"


async def _after(seconds: float, started: Any) -> Any:
    await asyncio.sleep(seconds)
    return await started
