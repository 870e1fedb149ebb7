"""One call to the echo_headers test model (tests/models) and its outcome as a string: what the
credential tests (tests/stack/test_token_auth.py, tests/gateway/test_jwt.py) compare; the
gateway tier's stand-in Triton answers it too."""

from __future__ import annotations

import contextlib
import json
import queue
from collections.abc import Callable

import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from local_stack.triton_inputs import tensor
from tests.support.raw_http import request


def echo_inputs() -> list[tc.InferInput]:
    return [tensor("INPUT", np.array([1], np.int32), "INT32")]


def outcome(call: Callable[[], object]) -> str:
    """"OK", or the status and message the call ended with."""
    try:
        call()
    except InferenceServerException as error:
        return f"{error.status()}: {error.message()}"
    return "OK"


def infer_with_token(url: str, token: str | None) -> str:
    """echo_headers called with `authorization: Bearer <token>` (none when None)."""
    headers = {"authorization": f"Bearer {token}"} if token is not None else None
    client = tc.InferenceServerClient(url)
    return outcome(lambda: client.infer("echo_headers", echo_inputs(), headers=headers,
                                        client_timeout=30))


def stream_with_token(url: str, token: str | None) -> object:
    """echo_headers over one ModelStreamInfer stream with that token: its first result, or the
    error that ended it (the refusal comes through the callback whether the gateway refuses the
    stream before or after the request is sent)."""
    results: queue.Queue[object] = queue.Queue()
    client = tc.InferenceServerClient(url)
    headers = {"authorization": f"Bearer {token}"} if token else None
    client.start_stream(callback=lambda result, error: results.put(error or result),
                        headers=headers, stream_timeout=30)
    try:
        with contextlib.suppress(InferenceServerException):
            client.async_stream_infer("echo_headers", echo_inputs())
        return results.get(timeout=30)
    finally:
        client.stop_stream()


def http_refusals(http_url: str, tokens: tuple[str | None, ...]) -> list[str]:
    """Each HTTP call with one of `tokens` (None: no header) that was not refused as a missing
    token is (401, Triton's error shape saying what to send, WWW-Authenticate: Bearer)."""
    wrong = []
    for token in tokens:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        for method, path in (("GET", "/v2/health/ready"), ("GET", "/v2/models/echo_headers"),
                             ("POST", "/v2/repository/index")):
            status, answer_headers, body = request(http_url, method, path, headers=headers)
            if not (status == 401 and "Bearer" in json.loads(body or "{}").get("error", "")
                    and answer_headers.get("www-authenticate") == "Bearer"):
                wrong.append(f"{token} {method} {path}: {status} {answer_headers} {body!r}")
    return wrong
