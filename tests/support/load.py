"""Load for the stack tests: callers in a loop on one channel, and an autoscaling cycle
(load until replicas rise, then quiet until they fall) with a timeline of running replicas."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from local_stack.harness import RunningStack
from local_stack.polling import until
from local_stack.ray_cluster import replicas
from local_stack.triton_inputs import simple_inputs, tensor

DEADLINE_S = 10.0
Outcome = tuple[float, str, float]  # (started, status, seconds)


def _simple() -> list[tc.InferInput]:
    a = np.ones((1, 16), dtype=np.int32)
    return simple_inputs(a, a)


def _slow(seconds: float) -> list[tc.InferInput]:
    return [tensor("SECONDS", np.array([seconds], dtype=np.float32), "FP32")]


async def load(url: str, seconds: float, callers: int, model: str = "simple",
                slow_s: float = 0.3, stop: asyncio.Event | None = None) -> list[Outcome]:
    """Callers on one channel, each calling in a loop until `seconds` have passed or `stop`
    is set."""
    outcomes: list[Outcome] = []
    client = tc_aio.InferenceServerClient(url)
    end = time.monotonic() + seconds

    async def caller() -> None:
        while time.monotonic() < end and not (stop and stop.is_set()):
            started = time.monotonic()
            inputs = _slow(slow_s) if model == "slow" else _simple()
            try:
                await client.infer(model, inputs, client_timeout=DEADLINE_S)
                status = "OK"
            except InferenceServerException as error:
                status = str(error.status())
                await asyncio.sleep(0.1)
            outcomes.append((started, status, time.monotonic() - started))

    try:
        await asyncio.gather(*(caller() for _ in range(callers)))
    finally:
        await client.close()
    return outcomes


def _running(running: RunningStack) -> int:
    dashboard = f"http://127.0.0.1:{running.ports['RAY_DASHBOARD_PORT']}"
    return [r["state"] for r in replicas(dashboard, running.ray_token)].count("RUNNING")


def scale_cycle(running: RunningStack, load_max_s: float = 60, after_up_s: float = 5,
                watch_s: float = 60, callers: int = 12
                ) -> tuple[list[tuple[float, int]], list[Outcome]]:
    """Waits for one running replica, loads the slow model with `callers` until a second
    replica has run for `after_up_s` (at most `load_max_s`), and records the running replicas
    every second until they are one again (at most `watch_s` after the load)."""
    until("one running replica", lambda: (count := _running(running)) == 1
          or f"{count} running", 120, every_s=0.5)
    timeline: list[tuple[float, int]] = []

    async def cycle() -> list[Outcome]:
        start = time.monotonic()
        stop = asyncio.Event()
        task = asyncio.ensure_future(load(running.url("GRPC_PORT"), load_max_s, callers,
                                          "slow", 0.3, stop))
        up_at: float | None = None
        while True:
            count = await asyncio.to_thread(_running, running)
            now = time.monotonic()
            timeline.append((round(now - start, 1), count))
            if up_at is None and count > 1:
                up_at = now
            if up_at is not None and now - up_at >= after_up_s:
                stop.set()
            # Done once back to one after the rise; at once if none came (the caller's
            # assertion says so), and at most `watch_s` after the load.
            if task.done() and (up_at is None or count == 1
                                or now - start > load_max_s + watch_s):
                return task.result()
            await asyncio.sleep(1)

    outcomes = asyncio.run(cycle())
    failed = [s for _, s, _ in outcomes if s != "OK"]
    print(f"replicas over time (s, running): {timeline}; {len(outcomes)} calls, "
          f"{len(failed)} failed")
    return timeline, outcomes
