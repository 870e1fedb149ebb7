"""The pod's readiness as its replica sees it: Triton ready and its models warm.

The Triton container's readinessProbe (base/rayservice.yaml) asks this endpoint, not Triton: a
pod is Ready, so listed by the headless Service the gateway balances over, only once its
replica has warmed the models (warmup.py), and not while Triton is not ready. Nothing listens
until the replica starts, and nothing once it has gone, so a pod without its replica is never
Ready (invariant triton-ready-means-warm checks the probe against the Serve config's
`ready_port`). `make local` and `make cluster` ask the same endpoint (local_stack/stack.py's
Discovery; the cluster tier runs the probe from the built manifests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger("ray.serve")

READY_PATH = "/ready"
# Set only by `make local`, whose simulated pods share one host: each replica's own port.
POD_READY_PORT_ENV = "SONIC_RAY_POD_READY_PORT"
# Well within the probe's timeoutSeconds (1 s by default): a busy Triton's slower answer to
# ServerReady must not fail the probe (invariant triton-ready-means-warm).
TRITON_CHECK_S = 0.5
_MAX_REQUEST_BYTES = 8192


class PodReadiness:
    """Answers GET READY_PATH with 200 while this pod may take calls, else 503 saying why."""

    def __init__(self, triton_ready: Callable[[], Awaitable[str | None]]) -> None:
        # triton_ready(): None while Triton answers ready, else why not.
        self._triton_ready = triton_ready
        self.warm = False
        self.reason = "its models are not warm yet"
        # Set when Serve stops the replica (pod.py's _leave): the pod leaves the ready ones
        # for good, whatever its Triton and its models say.
        self.stopping = False
        self._server: asyncio.Server | None = None

    async def start(self, port: int) -> None:
        self._server = await asyncio.start_server(self._answer, "0.0.0.0", port)
        logger.info("the pod's readiness answers on port %d (%s)", port, READY_PATH)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def verdict(self) -> str | None:
        """None when the pod may take calls, else why not."""
        if self.stopping:
            return "its replica is stopping"
        if not self.warm:
            return self.reason
        return await self._triton_ready()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def answer(head: bytes) -> tuple[str, str]:
            method, path = [*head.split(b" ", 2), b"", b""][:2]
            if method != b"GET" or path.split(b"?")[0] != READY_PATH.encode():
                return "404 Not Found", f"only GET {READY_PATH} is answered here"
            why = await self.verdict()
            return ("200 OK", "ready") if why is None else (
                "503 Service Unavailable", f"not ready: {why}")

        await answer_once(reader, writer, answer)


async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      answer: Callable[[bytes], Awaitable[tuple[str, str]]]) -> None:
    """One plain-text HTTP answer on a connection of its own (a probe's, a health check's):
    the request's head read within 5 s and at most _MAX_REQUEST_BYTES, `answer(head)` gives
    the status line and the text, then the connection closes."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        if len(head) > _MAX_REQUEST_BYTES:
            raise ValueError("request too large")
        status, text = await answer(head)
        body = (text + "\n").encode()
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body)
        await writer.drain()
    except (TimeoutError, ValueError, asyncio.IncompleteReadError,
            asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()
