"""The Serve deployment, one replica per Triton pod: the control plane of both data paths.

Each replica holds its pod's `triton` resource, becomes ready only once its Triton answers
ServerReady, fails its health check when Triton does not answer ServerLive, and reports its
Triton's queue time to Serve's autoscaler (autoscaling.py turns that into replicas, the Ray
autoscaler into GPU pods). On the gateway path (the default) Envoy carries the calls and the
replica only steers; on the Serve path Serve's gRPC proxy hands each call to a replica, which
forwards it to the Triton in its own pod, bytes in and bytes out, and Serve's HTTP proxy does
the same with Triton's HTTP/REST API (http_forwarding.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from .access import ADMIN_HEADER, AUTHORIZATION, UNAUTHENTICATED, TokenCheck, admin_key
from .http_forwarding import HttpForwarder
from .rpcs import BY_NAME, REFUSABLE, RPCS, Rpc, refusal_message
from .servicer import TIMEOUT_KEY
from .triton_metrics import QUEUE_METRIC, QueueTime, scrape

logger = logging.getLogger("ray.serve")

# The largest message gRPC can frame (a signed 32-bit length).
MAX_MESSAGE_BYTES = 2**31 - 1

# Metadata that belongs to a hop, not to the call: Serve's routing keys and the deadline key.
_HOP_METADATA = frozenset(
    {"application", "request_id", "multiplexed_model_id", "session_id", TIMEOUT_KEY,
     # Never passed on: the client's credentials, and a key only the forwarder may send.
     AUTHORIZATION, ADMIN_HEADER}
)
# Set only by `make local`, whose simulated pods share one host: each Ray node's replica talks
# to its own Triton, as a pod's does on localhost.
TRITON_ADDRESS_ENV = "SONIC_RAY_TRITON_ADDRESS"
TRITON_HTTP_ADDRESS_ENV = "SONIC_RAY_TRITON_HTTP_ADDRESS"
TRITON_METRICS_URL_ENV = "SONIC_RAY_TRITON_METRICS_URL"


class ForwarderArgs(BaseModel):
    """The application's `args` in the Serve config; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    triton_address: str = Field(
        "localhost:8001", description="host:port of the Triton gRPC endpoint in this pod"
    )
    triton_http_address: str = Field(
        "localhost:8100",
        description="host:port of the Triton HTTP endpoint in this pod (Serve path's HTTP)",
    )
    triton_metrics_url: str = Field(
        "http://localhost:8002/metrics",
        description="Triton's Prometheus metrics in this pod: the autoscaling signal",
    )
    allowed_admin_rpcs: list[str] = Field(
        default_factory=list,
        description="RPCs refused by default that this deployment should forward anyway",
    )
    ready_timeout_s: float = Field(
        600.0, gt=0, description="how long a new replica waits for Triton's ServerReady"
    )
    health_timeout_s: float = Field(
        5.0, gt=0, description="deadline of the ServerLive call of each health check"
    )
    max_message_bytes: int = Field(MAX_MESSAGE_BYTES, gt=0, le=MAX_MESSAGE_BYTES)

    @field_validator("allowed_admin_rpcs")
    @classmethod
    def _known_rpcs(cls, names: list[str]) -> list[str]:
        unknown = sorted(set(names) - REFUSABLE)
        if unknown:
            raise ValueError(
                f"allowed_admin_rpcs: {unknown} are not refusable Triton RPCs; "
                f"choose from {sorted(REFUSABLE)}"
            )
        return names


class CallContext(Protocol):
    """What the forwarder uses of Serve's RayServegRPCContext."""

    def invocation_metadata(self) -> Any: ...
    def set_code(self, code: Any) -> None: ...
    def set_details(self, details: str) -> None: ...
    def set_trailing_metadata(self, trailing_metadata: Any) -> None: ...


class RawMessage:
    """A message's bytes, with the one method Serve's replica calls on a gRPC result."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf method name Serve calls
        return self.data


def _forwarded_metadata(context: CallContext) -> tuple[list[tuple[str, Any]], float | None]:
    metadata: list[tuple[str, Any]] = []
    timeout: float | None = None
    for key, value in context.invocation_metadata():
        if key == TIMEOUT_KEY:
            # Written by the proxy side (servicer.py), which drops any a client sent; still,
            # a value that is not a number means no deadline rather than a failed call.
            try:
                timeout = float(value)
            except (TypeError, ValueError):
                timeout = None
        elif key not in _HOP_METADATA and not key.startswith(":"):
            metadata.append((key, value))
    return metadata, timeout


async def _copy_status(call: Any, context: CallContext) -> None:
    """Gives the client Triton's status, details and trailing metadata as Triton sent them."""
    code = await call.code()
    trailing = await call.trailing_metadata()
    if trailing:
        context.set_trailing_metadata([(key, value) for key, value in trailing])
    if code != grpc.StatusCode.OK:
        context.set_code(code)
        context.set_details(await call.details() or "")


class StreamEndedError(Exception):
    """Ends a stream whose status is not OK.

    Serve's classic proxy copies a stream's context to the client only together with a
    message, so a status set after the last message (or on a stream with none) would reach the
    client as OK. Raised with the code already on the context, it reaches the client as that
    code and these details, on the classic proxy and on direct-ingress replicas alike.
    """


class TritonForwarder:
    # Serve awaits an async constructor, so a replica counts as started only once its Triton
    # is ready.
    async def __init__(self, args: ForwarderArgs) -> None:  # type: ignore[misc]
        address = os.environ.get(TRITON_ADDRESS_ENV) or args.triton_address
        http_address = os.environ.get(TRITON_HTTP_ADDRESS_ENV) or args.triton_http_address
        metrics_url = os.environ.get(TRITON_METRICS_URL_ENV) or args.triton_metrics_url
        args = args.model_copy(update={"triton_address": address,
                                       "triton_http_address": http_address,
                                       "triton_metrics_url": metrics_url})
        self._args = args
        self._queue_time = QueueTime()
        options = [
            ("grpc.max_send_message_length", args.max_message_bytes),
            ("grpc.max_receive_message_length", args.max_message_bytes),
            # Triton restarts in place; reconnect quickly instead of backing off for minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._channel = grpc.aio.insecure_channel(args.triton_address, options=options)
        self._unary = {
            rpc.name: self._channel.unary_unary(rpc.path) for rpc in RPCS if not rpc.streaming
        }
        self._streams = {
            rpc.name: self._channel.stream_stream(rpc.path) for rpc in RPCS if rpc.streaming
        }
        self._allowed = frozenset(args.allowed_admin_rpcs)
        self._tokens = TokenCheck.from_env()
        self._admin_key = admin_key()
        self._http = HttpForwarder(args.triton_http_address, self._allowed, self._tokens,
                                   self._admin_key)
        await self._wait_for_triton()

    async def _wait_for_triton(self) -> None:
        address = self._args.triton_address
        deadline = time.monotonic() + self._args.ready_timeout_s
        next_log = 0.0
        last_error = ""
        while True:
            try:
                # ServerReady answers OK with ready=false while models load; its only field
                # is that bool, which serialises to b"\x08\x01" when true.
                reply = await self._unary["ServerReady"](b"", timeout=2.0)
                if reply == b"\x08\x01":
                    logger.info("Triton at %s is ready", address)
                    return
                last_error = "ServerReady answered ready=false"
            except grpc.aio.AioRpcError as error:
                last_error = f"{error.code().name}: {error.details()}"
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"Triton at {address} was not ready within "
                    f"{self._args.ready_timeout_s:.0f}s (last answer: {last_error})"
                )
            if now >= next_log:
                logger.info("waiting for Triton at %s to be ready (%s)", address, last_error)
                next_log = now + 10.0
            await asyncio.sleep(0.5)

    async def __call__(self, request: Request) -> Response:
        """Serve's HTTP proxy: Triton's HTTP/REST API, passed to this pod's Triton."""
        return await self._http.forward(request)

    async def check_health(self) -> None:
        """Serve's health check: a Triton that does not answer ServerLive fails the replica."""
        try:
            reply = await self._unary["ServerLive"](b"", timeout=self._args.health_timeout_s)
        except grpc.aio.AioRpcError as error:
            raise RuntimeError(
                f"Triton at {self._args.triton_address} is not live: "
                f"{error.code().name}: {error.details()}"
            ) from error
        if reply != b"\x08\x01":
            raise RuntimeError(f"Triton at {self._args.triton_address} reports live=false")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook: this replica's Triton queue time per execution."""
        counters = await asyncio.to_thread(scrape, self._args.triton_metrics_url, 5.0)
        return {QUEUE_METRIC: self._queue_time.update(counters)}

    def _refusal(self, rpc: Rpc, context: CallContext) -> str | None:
        """Why this call is refused (code and details then set on the context), or None."""
        # Unary refusals stay answers, not exceptions: Serve logs a stack trace for every
        # exception, and a refusal is an answer, not a fault.
        if self._tokens is not None and not self._tokens.allows(context.invocation_metadata()):
            context.set_code(grpc.StatusCode.UNAUTHENTICATED)
            context.set_details(UNAUTHENTICATED)
            return UNAUTHENTICATED
        if rpc.refused(self._allowed):
            context.set_code(grpc.StatusCode.PERMISSION_DENIED)
            context.set_details(refusal_message(rpc))
            return refusal_message(rpc)
        return None

    async def forward_unary(
        self, rpc: Rpc, request: bytes, context: CallContext
    ) -> RawMessage:
        if self._refusal(rpc, context) is not None:
            return RawMessage(b"")
        metadata, timeout = _forwarded_metadata(context)
        if rpc.restricted and self._admin_key:
            metadata.append((ADMIN_HEADER, self._admin_key))
        call = self._unary[rpc.name](request, metadata=metadata, timeout=timeout)
        try:
            reply = await call
        except grpc.aio.AioRpcError:
            reply = b""
        await _copy_status(call, context)
        return RawMessage(reply)

    async def forward_stream(
        self, rpc: Rpc, requests: AsyncIterator[bytes], context: CallContext
    ) -> AsyncIterator[RawMessage]:
        refusal = self._refusal(rpc, context)
        if refusal is not None:
            raise StreamEndedError(refusal)
        metadata, timeout = _forwarded_metadata(context)
        call = self._streams[rpc.name](requests, metadata=metadata, timeout=timeout)
        try:
            async for reply in call:
                yield RawMessage(reply)
        except grpc.aio.AioRpcError:
            pass
        finally:
            # A client that went away cancels the stream to Triton too.
            call.cancel()
        await _copy_status(call, context)
        if await call.code() != grpc.StatusCode.OK:
            raise StreamEndedError(await call.details() or "")


def _unary_method(rpc: Rpc) -> Any:
    async def method(
        self: TritonForwarder, request: bytes, grpc_context: CallContext
    ) -> RawMessage:
        return await self.forward_unary(rpc, request, grpc_context)

    method.__name__ = method.__qualname__ = rpc.name
    return method


def _stream_method(rpc: Rpc) -> Any:
    async def method(
        self: TritonForwarder, request_stream: AsyncIterator[bytes],
        grpc_context: CallContext,
    ) -> AsyncIterator[RawMessage]:
        async for reply in self.forward_stream(rpc, request_stream, grpc_context):
            yield reply

    method.__name__ = method.__qualname__ = rpc.name
    return method


# Serve's proxy calls the replica method named like the RPC.
for _rpc in RPCS:
    setattr(TritonForwarder, _rpc.name, (_stream_method if _rpc.streaming else _unary_method)(_rpc))

TritonForwarderDeployment: Any = serve.deployment(TritonForwarder, name="TritonForwarder")


def build_app(args: dict[str, Any]) -> Any:
    """The application builder that the Serve config's `import_path` names: the app's `args`
    are checked here, so a misspelt key fails the deploy with a message naming it."""
    return TritonForwarderDeployment.bind(ForwarderArgs.model_validate(args))


__all__ = ["BY_NAME", "ForwarderArgs", "TritonForwarder", "build_app"]
