"""Triton dies under load: every in-flight and new call ends within its deadline with a status,
the stack restarts Triton as the kubelet would, and calls succeed again once it is back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from local_stack.triton_inputs import simple_inputs
from tests.stack.conftest import Stack

DEADLINE_S = 10.0
# The load ends once calls have succeeded again on both protocols for this long after the
# kill's last failure (or after LOAD_S): recovery seen, not a fixed minute waited out.
RECOVERED_FOR_S = 5.0
LOAD_S = 60.0


def _inputs() -> list[tc.InferInput]:
    a = np.ones((1, 16), dtype=np.int32)
    return simple_inputs(a, a)


@pytest.mark.disruptive
def test_triton_killed_under_load_calls_end_with_a_status_then_recover(stack: Stack) -> None:
    seen = len(stack.process.lines)
    # (started, status, seconds); `started` on the monotonic clock, made relative to the kill
    # once it happened: calls before it are never counted as recovered after it.
    outcomes: list[tuple[float, str, float]] = []
    killed_at: float | None = None
    recovered_event = asyncio.Event()

    async def load(seconds: float) -> None:
        client = tc_aio.InferenceServerClient(stack.url)
        end = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < end and not recovered_event.is_set():
                started = time.monotonic()
                try:
                    # Half of the calls sit in Triton for a moment, so some are in flight at the kill.
                    slow = tc.InferInput("SECONDS", [1], "FP32")
                    slow.set_data_from_numpy(np.array([0.2], dtype=np.float32))
                    if int(started * 10) % 2:
                        await client.infer("slow", [slow], client_timeout=DEADLINE_S)
                    else:
                        await client.infer("simple", _inputs(), client_timeout=DEADLINE_S)
                    status = "OK"
                except InferenceServerException as error:
                    status = str(error.status())
                    await asyncio.sleep(0.2)
                outcomes.append((started, status, time.monotonic() - started))

        try:
            await asyncio.gather(*(worker() for _ in range(8)))
        finally:
            await client.close()

    http_outcomes: list[tuple[float, str, float]] = []

    async def http_load(seconds: float) -> None:
        """Triton's HTTP API at the same time: every request must end with a status."""
        end = time.monotonic() + seconds
        body = {"inputs": [{"name": name, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
                           for name in ("INPUT0", "INPUT1")]}
        timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def worker() -> None:
                while time.monotonic() < end and not recovered_event.is_set():
                    started = time.monotonic()
                    try:
                        async with session.post(f"http://{stack.http_url}/v2/models/simple/infer",
                                                json=body) as response:
                            answer = await response.read()
                            status = str(response.status)
                            if response.status != 200:
                                status += f" {json.loads(answer).get('error', '')[:60]!r}"
                                await asyncio.sleep(0.2)
                    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                        status = f"no status: {type(error).__name__}"
                    http_outcomes.append((started, status, time.monotonic() - started))

            await asyncio.gather(*(worker() for _ in range(4)))

    async def watch() -> None:
        while not (_recovered(outcomes, "OK", killed_at)
                   and _recovered(http_outcomes, "200", killed_at)):
            await asyncio.sleep(0.5)
        recovered_event.set()

    async def kill_under_load() -> None:
        nonlocal killed_at
        task = asyncio.gather(load(LOAD_S), http_load(LOAD_S))
        await asyncio.sleep(3)
        killed_at = time.monotonic()
        os.kill(stack.process.triton_pid(), signal.SIGKILL)
        watcher = asyncio.ensure_future(watch())
        await task
        watcher.cancel()

    asyncio.run(kill_under_load())
    assert killed_at is not None
    outcomes = _after(outcomes, killed_at)
    http_outcomes = _after(http_outcomes, killed_at)
    stack.process.wait_for_line(r"triton 0 exited with status -9; restarting", 30, after=seen)
    stack.process.wait_for_line(r"triton 0 started \(pid \d+\)", 60, after=seen)

    failed = [o for o in outcomes if o[1] != "OK"]
    longest = max(seconds for _, _, seconds in outcomes)
    last_failure = max((t for t, s, _ in outcomes if s != "OK"), default=0.0)
    recovered = [t for t, s, _ in outcomes if s == "OK" and t > last_failure]
    print(f"Triton killed under load: {len(outcomes)} calls, {len(failed)} ended with a status "
          f"({sorted({s for _, s, _ in failed})}), 0 hung, longest {longest:.1f}s; last failed "
          f"call started {last_failure:.1f}s after the kill, calls succeed again from "
          f"{min(recovered, default=float('nan')):.1f}s")
    assert failed, "the kill went unnoticed: was Triton really killed?"
    assert longest < DEADLINE_S + 2, f"a call hung for {longest:.1f}s"
    assert {s for _, s, _ in failed} <= {
        "StatusCode.UNAVAILABLE", "StatusCode.INTERNAL", "StatusCode.CANCELLED",
        "StatusCode.DEADLINE_EXCEEDED"}
    assert recovered, "no call succeeded after Triton came back"

    http_failed = sorted({s for _, s, _ in http_outcomes if s != "200"})
    http_last_failure = max((t for t, s, _ in http_outcomes if s != "200"), default=0.0)
    print(f"over HTTP: {len(http_outcomes)} requests, answers other than 200: {http_failed}, "
          f"longest {max(s for _, _, s in http_outcomes):.1f}s")
    assert http_failed, "the kill went unnoticed over HTTP"
    # Each one a status from the endpoint, with Triton's error shape: none hung or was cut off.
    assert all(s.split()[0] in {"502", "503", "504"} for s in http_failed), http_failed
    assert any(t > http_last_failure and s == "200" for t, s, _ in http_outcomes), (
        "no HTTP request succeeded after Triton came back")
    for _ in range(20):
        result = tc.InferenceServerClient(stack.url).infer("simple", _inputs(),
                                                                  client_timeout=30)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2))


def _after(outcomes: list[tuple[float, str, float]],
           killed_at: float) -> list[tuple[float, str, float]]:
    """Each call's start made relative to the kill (negative: started before it)."""
    return [(started - killed_at, status, took) for started, status, took in outcomes]


def _recovered(outcomes: list[tuple[float, str, float]], ok: str,
               killed_at: float | None) -> bool:
    """Whether calls started after the kill's last failure have succeeded for
    RECOVERED_FOR_S; False until the kill cost a call."""
    if killed_at is None:
        return False
    after = _after(list(outcomes), killed_at)
    failures = [t for t, status, _ in after if t >= 0 and status != ok]
    if not failures:
        return False
    since = [t for t, status, _ in after if status == ok and t > max(failures)]
    return bool(since) and max(since) - min(since) >= RECOVERED_FOR_S
