"""What a bounded queue costs a Triton under overload (docs/admission.md, Backpressure).

One Triton alone (no gateway, no Ray) serves the overload cell's `queue_limited` model three
ways, open-loop calls at twice what that way can serve, straight to it:

- one instance, Triton's queue bounded at one batch: after a batch Triton's batcher may wait
  up to 500 ms before it gives the idle instance the next (no prefetch under a queue policy,
  and a race in Triton core), so about half the capacity is served;
- one instance, no queue policy, the bound held outside Triton (the caller refuses a call at
  once while IN_FLIGHT are under way, as a gateway could): batches back to back;
- as shipped (two instances, a queue of one batch each): the other instance's batch ending
  wakes the batcher, batches back to back with Triton's own bound.

Each run prints what was admitted, its p99 against one call alone and the Triton's own
executions per second.

    python -m bench.queue_policy [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from local_stack import triton
from local_stack.overload import (
    BATCH,
    EXEC_S,
    INSTANCES,
    MODEL,
    TritonCounts,
    infer,
    model_setting,
    open_loop,
    p99,
)
from local_stack.triton import TEST_MODELS

# Calls under way on the Triton when the bound is outside it: the batch executing and the next.
IN_FLIGHT = 8
INSTANCE_COUNT = re.compile(r"count: \d+")
QUEUE_POLICY = re.compile(r"\n\s*default_queue_policy \{[^}]*\}\n")
QUEUE_SIZE = re.compile(r"max_queue_size: \d+")


@dataclass(frozen=True)
class Way:
    label: str
    instances: int
    queue: int | None  # Triton's max_queue_size; None: no queue policy, IN_FLIGHT held here

    @property
    def capacity_per_s(self) -> float:
        return self.instances * BATCH / EXEC_S


WAYS = (Way("one instance, a queue of one batch", 1, BATCH),
        Way(f"one instance, no queue policy, {IN_FLIGHT} in flight held by the caller", 1, None),
        Way(f"as shipped: {INSTANCES} instances, a queue of {model_setting('max_queue_size')}",
            INSTANCES, model_setting("max_queue_size")))


def _sub(pattern: re.Pattern[str], new: str, text: str, config: Path) -> str:
    text, found = pattern.subn(new, text)
    if found != 1:
        raise RuntimeError(f"{config}: expected one {pattern.pattern!r}, found {found}")
    return text


def model_repository(into: Path, way: Way) -> Path:
    """The model with `way`'s instances and queue."""
    shutil.copytree(TEST_MODELS / MODEL, into / MODEL)
    config = into / MODEL / "config.pbtxt"
    text = _sub(INSTANCE_COUNT, f"count: {way.instances}", config.read_text(), config)
    text = (_sub(QUEUE_POLICY, "\n", text, config) if way.queue is None
            else _sub(QUEUE_SIZE, f"max_queue_size: {way.queue}", text, config))
    config.write_text(text)
    return into


def run(directory: Path, backends: Path, way: Way, seconds: float) -> str:
    repo = model_repository(directory / f"{way.instances}-{way.queue}", way)
    with triton.lone(repo, backends, directory / "triton.log", _ready) as (url, _):
        return f"{asyncio.run(_load(url, way, seconds))} ({way.label})"


def _ready(url: str) -> object:
    try:
        TritonCounts.read(url)
        return True
    except InferenceServerException as error:  # not up, or the model not loaded yet
        return str(error)


async def _load(url: str, way: Way, seconds: float) -> str:
    """Open-loop calls at twice the way's capacity; without a queue policy, a call beyond
    IN_FLIGHT is refused here."""
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        alone = [(await infer(stub)).took_s for _ in range(10)]
        before = TritonCounts.read(url)
        rate = 2 * way.capacity_per_s
        outcomes, refused_here = await open_loop(
            stub, rate, seconds, time.monotonic(), IN_FLIGHT if way.queue is None else None)
    admitted = [o.took_s for o in outcomes if o.status == "OK"]
    return (f"{rate:.0f} calls/s for {seconds:.0f} s: admitted {len(admitted) / seconds:.1f}/s "
            f"of {way.capacity_per_s:.0f}, p99 {p99(admitted) * 1000:.0f} ms "
            f"({p99(admitted) / p99(alone):.1f}x one call alone, {p99(alone) * 1000:.0f} ms), "
            f"refused {len(outcomes) - len(admitted) + refused_here}; Triton "
            f"{TritonCounts.read(url).since(before, seconds)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sonic-ray-queue-policy-") as directory:
        backends = triton.prepare_backends(Path(directory) / "backends")
        for way in WAYS:
            print(run(Path(directory), backends, way, args.seconds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
