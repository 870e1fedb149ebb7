"""One call to the echo_headers test model (tests/models) and its outcome as a string: what the
credential tests (tests/stack/test_token_auth.py, tests/gateway/test_jwt.py) compare; the
gateway tier's stand-in Triton answers it too."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from local_stack.triton_inputs import tensor


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
