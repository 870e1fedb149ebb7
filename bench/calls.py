"""What the benches share: the calls they time (tritonclient.grpc.aio on the example and test
models: `simple` for small calls, `identity_fp32` for large ones), the CPU seconds of the
processes serving them, and where the figures go. No Ray: bench/node.py runs where Ray is not
installed."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio

from local_stack.processes import session_members
from local_stack.triton_inputs import simple_inputs, tensor

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
MIB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")

SIZES = {"small": 0, "1MiB": MIB, "16MiB": 16 * MIB}
def call_inputs(size: str) -> tuple[str, Callable[[], list[tc.InferInput]]]:
    if SIZES[size] == 0:
        data = np.arange(16, dtype=np.int32).reshape(1, 16)

        def small() -> list[tc.InferInput]:
            return simple_inputs(data, data)

        return "simple", small
    data = np.ones(SIZES[size] // 4, dtype=np.float32)

    def large() -> list[tc.InferInput]:
        return [tensor("INPUT", data, "FP32")]

    return "identity_fp32", large


def cpu_s(sids: list[int]) -> float:
    """CPU seconds (user + system: stat fields 14 and 15) of the live processes of sessions."""
    members = [fields for sid in sids for fields in session_members(sid).values()]
    return sum(int(fields[11]) + int(fields[12]) for fields in members) / CLK_TCK


Measured = tuple[int, list[float], int]  # calls done, their latencies, errors


@dataclass(frozen=True)
class Reduced:
    """A cell's repeated runs as one row: the median run's calls/s; p50 and p99 over every call
    of every run; errors and calls summed (calls at least 1, a divisor)."""
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    calls: int


def reduced(runs: Sequence[tuple[float, list[float], int]]) -> Reduced:
    """Runs as (calls/s, latencies in s, errors) each."""
    latencies = sorted(x for run in runs for x in run[1]) or [float("nan")]
    return Reduced(statistics.median(run[0] for run in runs),
                   1000 * latencies[len(latencies) // 2],
                   1000 * latencies[min(len(latencies) - 1, int(len(latencies) * .99))],
                   sum(run[2] for run in runs), max(1, len(latencies)))


async def timed(call: Callable[[], Awaitable[object]], concurrency: int,
                 seconds: float) -> Measured:
    """`concurrency` callers in a loop for `seconds`, after one warming call."""
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal errors
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                await call()
                latencies.append(time.perf_counter() - started)
            except Exception:
                errors += 1

    try:
        await call()  # warm the channel or connections
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    except Exception:
        errors += 1
    return len(latencies), latencies, errors


async def measure_grpc(url: str, size: str, concurrency: int, seconds: float,
                   ca: Path | None = None, headers: dict[str, str] | None = None) -> Measured:
    """`ca`: over TLS, trusting that CA; `headers`: sent with every call (a bearer token)."""
    model, make_inputs = call_inputs(size)
    options = [("grpc.max_send_message_length", 1 << 30),
               ("grpc.max_receive_message_length", 1 << 30)]
    client = tc_aio.InferenceServerClient(url, channel_args=options, ssl=ca is not None,
                                          root_certificates=str(ca) if ca else None)
    inputs = make_inputs()
    try:
        return await timed(lambda: client.infer(model, inputs, client_timeout=30,
                                                headers=headers), concurrency, seconds)
    finally:
        await client.close()
