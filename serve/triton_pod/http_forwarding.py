"""Triton's HTTP/REST API on the Serve path: Serve's HTTP proxy hands each request to a replica,
which passes it to the Triton in its own pod as bytes (method, path, query, headers and body),
and gives the client Triton's status, headers and body back, streamed as they come.

The refusals and token check are the gRPC ones (rpcs.py, access.py) in HTTP's words: 403 and
401 with a body in Triton's own error shape, {"error": "..."}; a Triton that does not answer
gives 503, never a hang."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .access import ADMIN_HEADER, AUTHORIZATION, HTTP_ADMIN_HEADER, UNAUTHENTICATED, TokenCheck
from .rpcs import HTTP_RESTRICTED, Rpc, refusal_message
from .sequences import (
    HTTP_INFER_PATH,
    HTTP_REFUSED_STATUS,
    INFERENCE_HEADER_LENGTH,
    KEPT_BYTES,
    SEQUENCE_ID_KEY,
    HttpAnswer,
    http_not_held,
)

# Matched against every request's path: compiled once.
_RESTRICTED_PATHS = tuple((re.compile(rpc.http_path), rpc) for rpc in HTTP_RESTRICTED)
_REPEATED_SLASHES = re.compile("/{2,}")
# Headers of one hop (RFC 9110 7.6.1), and those never passed on: the client's credentials
# and a key only the forwarder may send. Content-Length is set again for the bytes sent.
_NOT_FORWARDED = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "host",
    "content-length", AUTHORIZATION, HTTP_ADMIN_HEADER, ADMIN_HEADER,
})
_NOT_RETURNED = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
    "upgrade",
})
_CHUNK_BYTES = 1 << 20


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An answer in Triton's own error shape, which Triton's HTTP clients parse."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def restricted_rpc(path: str) -> Rpc | None:
    """The refusable or restricted call that an HTTP path names, if any."""
    return next((rpc for pattern, rpc in _RESTRICTED_PATHS if pattern.fullmatch(path)), None)


class _Copy:
    """The bytes of a request's body as they pass, while they fit in KEPT_BYTES, kept past the
    body's end only when its JSON header names a sequence (a plain call keeps nothing while
    Triton runs it)."""

    def __init__(self, header_bytes: int | None) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.whole = True
        # Binary-tensor requests give their JSON header's length (Inference-Header-Content-
        # Length); a JSON request's header is all of it.
        self._header_bytes = header_bytes

    def add(self, chunk: bytes) -> None:
        if not self.whole:
            return
        self.size += len(chunk)
        if self.size > KEPT_BYTES:
            self.chunks, self.whole = [], False
        else:
            self.chunks.append(chunk)

    def end(self) -> None:
        """The body has passed: the copy goes unless its header names a sequence."""
        if self.whole and SEQUENCE_ID_KEY not in self._header():
            self.chunks, self.whole = [], False

    def _header(self) -> bytes:
        if len(self.chunks) == 1 and self._header_bytes is None:
            return self.chunks[0]  # the common case, read in place
        return self.body()[:self._header_bytes]

    def body(self) -> bytes:
        return b"".join(self.chunks)


async def _body(request: Request, copy: _Copy | None = None) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            if copy is not None:
                copy.add(chunk)
            yield chunk
    if copy is not None:
        copy.end()


# Asks the other replicas an HTTP infer that this pod's Triton refused as not holding its
# sequence (method, path and query, headers, body); None: the refusal stands (pod.py).
HeldElsewhere = Callable[[str, str, list[tuple[str, str]], bytes], Awaitable[HttpAnswer | None]]


# How long a connection to Triton may sit idle before this pod closes it. Triton's graceful
# stop waits for every HTTP connection to close (--exit-timeout-secs, then it exits 1, "failed
# to stop server"): one the warm-up left idle held a deleted pod's Triton for the whole timeout
# (tests/stack/test_gateway.py, the pod removed as a scale-down).
IDLE_CLOSE_S = 2.0


class HttpForwarder:
    def __init__(self, address: str, allowed: frozenset[str], tokens: TokenCheck | None,
                 admin_key: str) -> None:
        self.address = address
        self._allowed = allowed
        self._tokens = tokens
        self._admin_key = admin_key
        self._session: aiohttp.ClientSession | None = None
        # Set by the replica (pod.py); without it an HTTP infer's refusal stands.
        self.held_elsewhere: HeldElsewhere | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use, inside the replica's event loop. No total timeout: an inference
        # takes as long as it takes, and a client that gives up cancels this call.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CLOSE_S),
            )
        return self._session

    async def call(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                   timeout_s: float) -> tuple[int, bytes]:
        """A call of this pod's own (the warm-up's, warmup.py) to its Triton, on the forwarder's
        connections, ended after `timeout_s`."""
        async with self._client().request(
                method, f"http://{self.address}{path}", data=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            return response.status, await response.read()

    async def ask(self, method: str, path: str, headers: list[tuple[str, str]],
                  body: bytes) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
        """Another replica's HTTP infer (sequences.py), to this pod's Triton, whole: its
        status, the headers a client gets, and its body."""
        sent = [(key, value) for key, value in headers if key.lower() != "content-length"]
        async with self._client().request(
                method, f"http://{self.address}{path}", headers=sent, data=body,
                allow_redirects=False,
                skip_auto_headers=("User-Agent", "Content-Type")) as response:
            returned = tuple((key, value) for key, value in response.headers.items()
                             if key.lower() not in _NOT_RETURNED)
            return response.status, returned, await response.read()

    async def forward(self, request: Request) -> Response:
        if self._tokens is not None and not self._tokens.allows(
                [(AUTHORIZATION, request.headers.get(AUTHORIZATION, ""))]):
            return error(401, UNAUTHENTICATED, {"www-authenticate": "Bearer"})
        # One spelling of each path: a refused endpoint is not reached through `//`.
        path = _REPEATED_SLASHES.sub("/", request.url.path)
        headers = [(key, value) for key, value in request.headers.items()
                   if key.lower() not in _NOT_FORWARDED]
        rpc = restricted_rpc(path)
        if rpc is not None:
            if rpc.refused(self._allowed):
                return error(403, refusal_message(rpc))
            if self._admin_key:
                headers.append((HTTP_ADMIN_HEADER, self._admin_key))
        target = path + ("?" + request.url.query if request.url.query else "")
        url = f"http://{self.address}{target}"
        length = request.headers.get("content-length")
        # An inference's body is kept for asking elsewhere (sequences.py), up to KEPT_BYTES.
        copy = _Copy(_header_bytes(request)) if (
            self.held_elsewhere is not None and HTTP_INFER_PATH.fullmatch(path)
            and (length is None or (length.isdigit() and int(length) <= KEPT_BYTES))) else None
        data: bytes | AsyncIterator[bytes]
        if length is not None:
            # Streamed to Triton as it arrives, with the client's length (no chunking).
            headers.append(("Content-Length", length))
            data = _body(request, copy)
        else:
            data = await request.body()
            if copy is not None:
                copy.add(data)
                copy.end()
        try:
            upstream = await self._client().request(
                request.method, url, headers=headers, data=data,
                allow_redirects=False, skip_auto_headers=("User-Agent", "Content-Type"),
            )
        except (aiohttp.ClientError, OSError) as exc:
            return error(503, f"Triton at {self.address} did not answer: {exc}")
        returned = [(key, value) for key, value in upstream.headers.items()
                    if key.lower() not in _NOT_RETURNED]
        if (copy is not None and copy.whole and self.held_elsewhere is not None
                and upstream.status == HTTP_REFUSED_STATUS):
            # A refusal is a short error: read whole, to see whether it is the sequence's.
            try:
                refusal = await upstream.read()
            finally:
                upstream.release()
            answer = None
            if http_not_held(upstream.status, refusal):
                answer = await self.held_elsewhere(request.method, target, headers,
                                                   copy.body())
            if answer is not None:
                return _whole(answer.status, list(answer.headers), answer.body)
            return _whole(upstream.status, returned, refusal)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.content.iter_chunked(_CHUNK_BYTES):
                    yield chunk
            finally:
                upstream.release()

        return _with_headers(StreamingResponse(body(), status_code=upstream.status), returned)


def _with_headers(response: Response, headers: list[tuple[str, str]]) -> Response:
    """The response with Triton's headers as Triton sent them (Starlette would add its own)."""
    response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in headers]
    return response


def _whole(status: int, headers: list[tuple[str, str]], body: bytes) -> Response:
    """An answer read whole, with Triton's headers as Triton sent them."""
    return _with_headers(Response(body, status_code=status), headers)


def _header_bytes(request: Request) -> int | None:
    """The length of a binary-tensor request's JSON header; None: the body is all JSON."""
    value = request.headers.get(INFERENCE_HEADER_LENGTH, "")
    return int(value) if value.isdigit() else None
