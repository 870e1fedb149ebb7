"""The Serve path's gRPC forwarding: Serve's gRPC proxy hands each call to a replica, which
passes it to the Triton in its own pod, bytes in and bytes out (never decoded), with Triton's
status, details and trailing metadata back. On the gateway path nothing here runs: Envoy
carries the calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from .access import ADMIN_HEADER, AUTHORIZATION, UNAUTHENTICATED, TokenCheck
from .rpcs import RPCS, Rpc, refusal_message
from .sequences import SEQUENCE_RPC, Answer, not_held
from .servicer import TIMEOUT_KEY

# The largest message gRPC can frame (a signed 32-bit length).
MAX_MESSAGE_BYTES = 2**31 - 1

# Metadata that belongs to a hop, not to the call: Serve's routing keys and the deadline key.
_HOP_METADATA = frozenset(
    {"application", "request_id", "multiplexed_model_id", "session_id", TIMEOUT_KEY,
     # Never passed on: the client's credentials, and a key only the forwarder may send.
     AUTHORIZATION, ADMIN_HEADER}
)

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


async def _call_unary(method: Any, request: bytes, metadata: list[tuple[str, Any]],
                      timeout: float | None) -> tuple[Any, bytes, grpc.aio.AioRpcError | None]:
    """One unary call to Triton: the call (for its status), its reply, and its error."""
    call = method(request, metadata=metadata, timeout=timeout)
    try:
        return call, await call, None
    except grpc.aio.AioRpcError as refused:
        return call, b"", refused


async def _status(call: Any) -> tuple[grpc.StatusCode, str, list[tuple[str, Any]]]:
    """Triton's status code, details and trailing metadata of a call, as Triton sent them."""
    code = await call.code()
    details = "" if code == grpc.StatusCode.OK else await call.details() or ""
    return code, details, [(key, value) for key, value in await call.trailing_metadata() or ()]


async def _copy_status(call: Any, context: CallContext) -> None:
    """Gives the client Triton's status, details and trailing metadata as Triton sent them."""
    code, details, trailing = await _status(call)
    if trailing:
        context.set_trailing_metadata(trailing)
    if code != grpc.StatusCode.OK:
        context.set_code(code)
        context.set_details(details)


def _give_answer(answer: Answer, context: CallContext) -> None:
    """Gives the client another replica's Triton's status, as _copy_status gives its own."""
    if answer.trailing:
        context.set_trailing_metadata(list(answer.trailing))
    if answer.code != grpc.StatusCode.OK.name:
        context.set_code(grpc.StatusCode[answer.code])
        context.set_details(answer.details)


class StreamEndedError(Exception):
    """Ends a stream whose status is not OK.

    Serve's classic proxy copies a stream's context to the client only together with a
    message, so a status set after the last message (or on a stream with none) would reach the
    client as OK. Raised with the code already on the context, it reaches the client as that
    code and these details, on the classic proxy and on direct-ingress replicas alike.
    """


class GrpcForwarding:
    """The replica's side of the Serve path's gRPC hop, mixed into the deployment: one method
    per RPC, named as Serve's proxy calls it (install_rpc_methods)."""

    _tokens: TokenCheck | None
    _allowed: frozenset[str]
    _admin_key: str
    _unary: dict[str, Any]
    _streams: dict[str, Any]

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
        call, reply, refused = await _call_unary(self._unary[rpc.name], request, metadata,
                                                 timeout)
        # Only a refused call is read for the sequence's words: an answered one costs nothing
        # more.
        if (refused is not None and rpc.name == SEQUENCE_RPC
                and not_held(refused.code(), refused.details() or "")):
            answer = await self._held_elsewhere(request, metadata, timeout)
            if answer is not None:
                _give_answer(answer, context)
                return RawMessage(answer.reply)
        await _copy_status(call, context)
        return RawMessage(reply)

    async def _held_elsewhere(self, request: bytes, metadata: list[tuple[str, Any]],
                              timeout: float | None) -> Answer | None:
        """Another replica's answer to a call of a sequence this pod's Triton does not hold
        (sequences.py); None: the refusal stands. Without replicas to ask (this mixin
        alone), None."""
        del request, metadata, timeout
        return None

    async def ask_triton(self, request: bytes, metadata: list[tuple[str, Any]],
                         timeout: float | None, me: str) -> Answer:
        """This pod's Triton's ModelInfer answer, whole, for another replica's call."""
        call, reply, _ = await _call_unary(self._unary[SEQUENCE_RPC], request, metadata,
                                           timeout)
        code, details, trailing = await _status(call)
        return Answer(me, code=code.name, details=details, trailing=tuple(trailing),
                      reply=reply)

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
        self: GrpcForwarding, request: bytes, grpc_context: CallContext
    ) -> RawMessage:
        return await self.forward_unary(rpc, request, grpc_context)

    method.__name__ = method.__qualname__ = rpc.name
    return method


def _stream_method(rpc: Rpc) -> Any:
    async def method(
        self: GrpcForwarding, request_stream: AsyncIterator[bytes],
        grpc_context: CallContext,
    ) -> AsyncIterator[RawMessage]:
        async for reply in self.forward_stream(rpc, request_stream, grpc_context):
            yield reply

    method.__name__ = method.__qualname__ = rpc.name
    return method


def install_rpc_methods(cls: type[GrpcForwarding]) -> None:
    """Serve's proxy calls the replica method named like the RPC."""
    for rpc in RPCS:
        setattr(cls, rpc.name, (_stream_method if rpc.streaming else _unary_method)(rpc))
