"""Triton dies under the forwarder: calls end fast with a status, the stack restarts Triton as
the kubelet would, and calls succeed again once it is back."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from tests.conftest import Stack


def _infer(url: str, timeout_s: float) -> None:
    a = np.ones((1, 16), dtype=np.int32)
    inputs = [tc.InferInput("INPUT0", [1, 16], "INT32"), tc.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    result = tc.InferenceServerClient(url).infer("simple", inputs, client_timeout=timeout_s)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)


@pytest.mark.disruptive
def test_triton_killed_calls_fail_fast_then_recover(stack: Stack) -> None:
    _infer(stack.serve_url, timeout_s=30)
    seen = len(stack.process.lines)
    os.kill(stack.process.triton_pid(), signal.SIGKILL)

    deadline_s = 10.0
    statuses = []
    for _ in range(5):
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as caught:
            _infer(stack.serve_url, timeout_s=deadline_s)
        elapsed = time.monotonic() - started
        statuses.append(caught.value.status())
        # Ended by the forwarder with a status, not left to run into the client's deadline.
        assert elapsed < deadline_s, f"call hung for {elapsed:.1f}s"
        assert caught.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.INTERNAL"), (
            caught.value.status(), caught.value.message())

    stack.process.wait_for_line(r"triton exited with status -9; restarting", 30, after=seen)
    stack.process.wait_for_line(r"triton started \(pid \d+\)", 60, after=seen)

    killed_at = time.monotonic()
    recovered_by = time.monotonic() + 240
    while True:
        try:
            _infer(stack.serve_url, timeout_s=10)
            break
        except InferenceServerException:
            if time.monotonic() > recovered_by:
                raise
            time.sleep(1)
    print(f"Triton killed: {len(statuses)} calls during the outage all ended with a status "
          f"({sorted(set(statuses))}); calls succeeded again "
          f"{time.monotonic() - killed_at:.1f}s after the restart was announced")
    for _ in range(20):
        _infer(stack.serve_url, timeout_s=30)
