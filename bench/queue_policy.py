"""What a bounded queue costs a Triton under overload (docs/admission.md, Backpressure).

One Triton alone (no gateway, no Ray) serves the overload cell's `queue_limited` model twice,
open-loop calls at twice its capacity straight to it: as shipped (`max_queue_size: 4`, Triton
refuses), and with its queue policy taken out and the bound held outside Triton instead (the
caller refuses a call at once while IN_FLIGHT are under way, as a gateway could). Each run
prints what was admitted, its p99 and the Triton's own executions per second. With its queue
bounded, Triton's batcher may wait up to 500 ms for the idle instance after each batch (no
prefetch under a queue policy); without, it runs batches back to back.

    python -m bench.queue_policy [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import tempfile
import time
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from bench import overload
from bench.overload import MODEL, TritonCounts, infer, open_loop, p99
from local_stack import triton
from local_stack.harness import TEST_MODELS

# One Triton's share of the overload cell's capacity.
CAPACITY_PER_S = overload.CAPACITY_PER_S / overload.TRITONS
# Calls under way on the Triton when the bound is outside it: the batch executing and the next.
IN_FLIGHT = 8
QUEUE_POLICY = re.compile(r"\n\s*default_queue_policy \{[^}]*\}\n")


def model_repository(into: Path, bounded: bool) -> Path:
    """The model as shipped, or with its dynamic batcher's queue policy removed."""
    shutil.copytree(TEST_MODELS / MODEL, into / MODEL)
    if not bounded:
        config = into / MODEL / "config.pbtxt"
        text, found = QUEUE_POLICY.subn("\n", config.read_text())
        if found != 1:
            raise RuntimeError(f"{config}: no default_queue_policy to take out")
        config.write_text(text)
    return into


def run(directory: Path, backends: Path, bounded: bool, seconds: float) -> str:
    repo = model_repository(directory / ("bounded" if bounded else "unbounded"), bounded)
    with triton.lone(repo, backends, directory / "triton.log", _ready) as (url, _):
        outside = None if bounded else IN_FLIGHT
        how = ("the model's queue policy as shipped" if bounded
               else f"no queue policy, {IN_FLIGHT} in flight")
        return f"{asyncio.run(_load(url, seconds, outside))} ({how})"


def _ready(url: str) -> object:
    try:
        TritonCounts.read(url)
        return True
    except InferenceServerException as error:  # not up, or the model not loaded yet
        return str(error)


async def _load(url: str, seconds: float, in_flight: int | None) -> str:
    """Open-loop calls at twice capacity; with `in_flight`, a call beyond it is refused here."""
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        alone = [(await infer(stub)).took_s for _ in range(10)]
        before = TritonCounts.read(url)
        rate = 2 * CAPACITY_PER_S
        outcomes, refused_here = await open_loop(stub, rate, seconds, time.monotonic(),
                                                 in_flight)
    admitted = [o.took_s for o in outcomes if o.status == "OK"]
    return (f"{rate:.0f} calls/s for {seconds:.0f} s: admitted {len(admitted) / seconds:.1f}/s, "
            f"p99 {p99(admitted) * 1000:.0f} ms (one call alone {p99(alone) * 1000:.0f} ms), "
            f"refused {len(outcomes) - len(admitted) + refused_here}; Triton "
            f"{TritonCounts.read(url).since(before, seconds)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sonic-ray-queue-policy-") as directory:
        backends = triton.prepare_backends(Path(directory) / "backends")
        for bounded in (True, False):
            print(run(Path(directory), backends, bounded, args.seconds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
