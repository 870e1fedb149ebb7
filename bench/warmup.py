"""What the warm-up costs at start and what it saves the first calls (docs/operations.md,
"Warm-up"): `make local` with two pods holding replicas, once with the warm-up on and once
turned off, serving the model tests/warmup_models/first_slow alone (3 s on each instance's
first execution, then milliseconds). For each: seconds from the start to
the ready line, the first calls' latencies through the gateway (spread over both pods), and
each replica's warm-up line. JSON to bench-results/.

    python -m bench.warmup [--calls 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc

from bench.calls import RESULTS
from local_stack.harness import running_stack, serve_config_with
from local_stack.triton_inputs import tensor

MODELS = Path(__file__).resolve().parent.parent / "tests" / "warmup_models"
MODEL = "first_slow"
PODS = 2


@dataclass
class Start:
    warmup: bool
    ready_s: float
    first_calls_s: list[float]
    warmup_lines: list[str]


def _start(warmup: bool, calls: int) -> Start:
    work = Path(tempfile.mkdtemp(prefix="sonic-ray-bench-warmup-"))
    try:
        shutil.copytree(MODELS / MODEL, work / "models" / MODEL)
        config = serve_config_with(work, autoscaling={"min_replicas": PODS, "max_replicas": PODS},
                                   args={"warmup": {"enabled": warmup}})
        began = time.monotonic()
        with running_stack({"TRITONS": str(PODS), "MODEL_REPOSITORY": str(work / "models"),
                            "SERVE_CONFIG": str(config)}) as stack:
            ready_s = time.monotonic() - began
            client = tc.InferenceServerClient(stack.url("GRPC_PORT"))
            took = []
            try:
                for _ in range(calls):
                    called = time.monotonic()
                    client.infer(MODEL, [tensor("INPUT0", np.ones((1, 4), np.float32), "FP32")],
                                 client_timeout=60)
                    took.append(time.monotonic() - called)
            finally:
                client.close()
            # Each replica's line for its pod (session_latest is a link to the session).
            logs = stack.process.workdir().glob("ray/session_2*/logs/serve/replica_*.log")
            said = (line.split(" -- ")[-1] for log in sorted(logs)
                    for line in log.read_text().splitlines())
            lines = [line for line in said if line.startswith("warm-up: ") and (
                "models warm in" in line or "turned off" in line)]
        return Start(warmup, ready_s, took, lines)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args(argv)
    starts = []
    for warmup in (True, False):
        print(f"warm-up {'on' if warmup else 'off'}: starting make local TRITONS={PODS}",
              flush=True)
        start = _start(warmup, args.calls)
        starts.append(start)
        print(f"  ready line after {start.ready_s:.1f} s; first {args.calls} calls (s): "
              f"{', '.join(f'{s:.3f}' for s in start.first_calls_s)}", flush=True)
        for line in start.warmup_lines:
            print(f"  {line}", flush=True)
    on, off = starts
    print(f"warm-up: the ready line {on.ready_s - off.ready_s:+.1f} s later; slowest first call "
          f"{max(on.first_calls_s):.3f} s with it, {max(off.first_calls_s):.3f} s without")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"warmup-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps([asdict(start) for start in starts], indent=2))
    print(f"figures: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
