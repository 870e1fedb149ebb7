"""`make bench`'s overload cell: the gateway at twice what its Tritons serve.

Two simulated pods at max_replicas serve the queue-bounded `queue_limited` model (tests/models:
0.2 s per batch, two instances, Triton's own queue policy); open-loop arrivals at twice that
capacity. Reports what was admitted (req/s, p99 against the unloaded p99), how fast the
rest was refused (RESOURCE_EXHAUSTED with a retry hint) and what share, and when the
start-of-job gate closed and opened again (docs/admission.md). tests/stack/test_admission.py
runs the same cell and asserts its outcome.

    python -m bench.overload [--seconds 60]
"""

from __future__ import annotations

import argparse

from local_stack.overload import TRITONS, TritonCounts, overload, saturable_stack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    print("overload: starting the stack (gateway, 2 pods)", flush=True)
    with saturable_stack() as running:
        tritons = [running.triton_url(pod) for pod in range(TRITONS)]
        before = [TritonCounts.read(url) for url in tritons]
        run = overload(running.url("GRPC_PORT"), args.seconds)
        print(run.summary(), flush=True)
        # Where the admitted calls' time went, by each Triton's own statistics over the load's
        # seconds (the 20 unloaded calls before it count in: a few percent of the executions).
        for url, earlier in zip(tritons, before, strict=True):
            print(f"  Triton {url}: {TritonCounts.read(url).since(earlier, args.seconds)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
