"""Registers Triton's service with Serve's gRPC proxy: the function that the Serve config's
`grpc_options.grpc_servicer_functions` names.

Handlers are registered without (de)serializers, so the proxy hands the replica the request's
raw bytes: tritonclient's generated message classes cannot be pickled between proxy and replica,
and nothing on the path needs to decode a tensor. Serve replaces every handler's behaviour with
its own routing, so the servicer argument is never called.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from .rpcs import RPCS, SERVICE

# Serve's context object does not carry the client's deadline, so the proxy side writes the
# remaining time into the request metadata under this key and the forwarder turns it back into
# a deadline on the call to Triton.
TIMEOUT_KEY = "sonic-ray-timeout-s"


def _handler(rpc_streaming: bool) -> grpc.RpcMethodHandler:
    if rpc_streaming:
        return grpc.stream_stream_rpc_method_handler(_never_called)
    return grpc.unary_unary_rpc_method_handler(_never_called)


def _never_called(*_: Any) -> Any:
    raise RuntimeError("Serve routes every Triton RPC to a replica; this handler never runs")


class _ContextWithDeadline:
    """The proxy's servicer context, with the remaining deadline added to the metadata."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        # Only this side may write the key: one a client sent is dropped.
        metadata = tuple((key, value) for key, value in self._context.invocation_metadata() or ()
                         if key != TIMEOUT_KEY)
        remaining = self._context.time_remaining()
        if remaining is None:
            return metadata
        return (*metadata, (TIMEOUT_KEY, f"{remaining:.6f}"))


def _with_deadline(handler: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            async for message in handler(request, _ContextWithDeadline(context)):
                yield message

        return stream

    @functools.wraps(handler)
    async def unary(request: Any, context: Any) -> Any:
        return await handler(request, _ContextWithDeadline(context))

    return unary


def _propagate_deadlines(server: Any) -> None:
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        # Ray's private hook moved: without it deadlines would silently stop reaching Triton.
        raise RuntimeError(
            f"{type(server).__name__} has no service_handler_factory: this Ray version's gRPC "
            "server is not the one triton_pod was written for (pinned: "
            "requirements.txt); deadlines could not reach Triton"
        )
    if getattr(factory, "_sonic_ray_deadlines", False):
        return

    def factory_with_deadlines(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        return _with_deadline(factory(*args, **kwargs))

    factory_with_deadlines._sonic_ray_deadlines = True  # type: ignore[attr-defined]
    server.service_handler_factory = factory_with_deadlines


def add_triton_servicer(servicer: Any, server: Any) -> None:
    """Adds `inference.GRPCInferenceService` to a gRPC server (Serve's proxy, or a replica's
    own server in direct-ingress modes)."""
    del servicer  # Serve passes a Mock; its routing replaces every handler.
    _propagate_deadlines(server)
    handlers = {rpc.name: _handler(rpc.streaming) for rpc in RPCS}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
