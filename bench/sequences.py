"""`make bench-sequences`: what a call of a sequence (a stateful model's) costs through the
gateway with two GPU pods, beside a call without one, in the same run (docs/speed.md,
"Sequences"). Two Tritons serve tests/sequence_models' `sequence_sum` and tests/models'
`identity_fp32`; the shipped gateway (gateway/envoy.yaml as `make local` runs it) is in front of
both. In each cell `concurrency` callers each run sequences of CALLS calls (START first, END
last), one after another, for `seconds`: through the gateway, and directly to the Triton that
holds each sequence (caller i on Triton i % 2); then the same callers with calls of the plain
model. Each row: calls/s as a ratio to direct, p50, Envoy's CPU per call and its tries per call
(a sequence's call refused by the Triton not holding it is tried on the other: 1.5 on average
with two pods). Ray not needed.

    python -m bench.sequences [--seconds 3] [--repeats 3] [--concurrency 1 8]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import secrets
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from bench.calls import RESULTS, cpu_s, reduced
from bench.node import gateway_config
from gateway import local as gateway
from local_stack import triton
from local_stack.gateway_config import gateway_env
from local_stack.polling import until
from local_stack.ports import free_ports
from local_stack.processes import spawn, terminate
from local_stack.settings import TritonPorts
from local_stack.triton import SEQUENCE_MODELS, TEST_MODELS, merged_model_repository

SEQUENCE_MODEL = "sequence_sum"
PLAIN_MODEL = "identity_fp32"
KINDS = ("sequence", "plain")
# Calls per sequence: a START, CALLS - 2 middle calls, an END.
CALLS = 10
TRITONS = 2
# Envoy's count of the calls it sent again (to another Triton), on its admin interface.
RETRIES_STAT = "cluster.triton.upstream_rq_retry"


@dataclass
class Row:
    kind: str
    path: str
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    envoy_cpu_us_per_call: float
    tries_per_call: float


def _ready(url: str) -> object:
    client = tc.InferenceServerClient(url)
    try:
        return (client.is_model_ready(SEQUENCE_MODEL)
                and client.is_model_ready(PLAIN_MODEL)) or "models loading"
    except InferenceServerException as error:
        return str(error)
    finally:
        client.close()


def _inputs(kind: str, value: int) -> list[tc_aio.InferInput]:
    if kind == "sequence":
        tensor = tc_aio.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], np.int32))
    else:
        tensor = tc_aio.InferInput("INPUT", [16], "FP32")
        tensor.set_data_from_numpy(np.ones(16, np.float32))
    return [tensor]


async def _load(kind: str, urls: list[str], concurrency: int,
                seconds: float) -> tuple[list[float], int]:
    """`concurrency` callers, caller i on urls[i % len(urls)], each running sequences (or
    plain calls) back to back for `seconds`: every call's latency and the errors."""
    clients = [tc_aio.InferenceServerClient(url) for url in urls]
    ids = itertools.count(secrets.randbelow(1 << 40) + 1)
    latencies: list[float] = []
    errors = 0
    end = time.monotonic() + seconds

    async def caller(client: tc_aio.InferenceServerClient) -> None:
        nonlocal errors
        while time.monotonic() < end:
            sequence = next(ids)
            for step in range(CALLS):
                started = time.perf_counter()
                try:
                    if kind == "sequence":
                        await client.infer(SEQUENCE_MODEL, _inputs(kind, step),
                                           sequence_id=sequence, sequence_start=step == 0,
                                           sequence_end=step == CALLS - 1)
                    else:
                        await client.infer(PLAIN_MODEL, _inputs(kind, step))
                    latencies.append(time.perf_counter() - started)
                except InferenceServerException:
                    errors += 1

    try:
        await asyncio.gather(*(caller(clients[i % len(clients)]) for i in range(concurrency)))
    finally:
        for client in clients:
            await client.close()
    return latencies, errors


def _retries(admin_port: int) -> int:
    url = f"http://127.0.0.1:{admin_port}/stats?filter=^{RETRIES_STAT}$"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return int(text.split(":")[1]) if ":" in text else 0


def _row(kind: str, path: str, concurrency: int,
         samples: list[tuple[float, list[float], int, float, int]]) -> Row:
    r = reduced([s[:3] for s in samples])
    return Row(kind, path, concurrency, r.rps, r.p50_ms, r.p99_ms, r.errors,
               1e6 * sum(s[3] for s in samples) / r.calls,
               1 + sum(s[4] for s in samples) / r.calls)


def run(concurrencies: list[int], seconds: float, repeats: int) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="sonic-ray-bench-sequences-") as directory, \
            ExitStack() as stack:
        work = Path(directory)
        repo = merged_model_repository([SEQUENCE_MODELS, TEST_MODELS])
        stack.callback(shutil.rmtree, repo, True)
        backends = triton.prepare_backends(work / "backends")
        direct: list[str] = []
        ports: list[TritonPorts] = []
        for i in range(TRITONS):
            http, grpc, metrics = free_ports(3)
            ports.append(TritonPorts(http=http, grpc=grpc, metrics=metrics))
            process = spawn(triton.command(repo, backends, ports[-1], secrets.token_hex(16), ()),
                            work / f"triton-{i}.log", triton.environment())
            stack.callback(terminate, process, 10)
            direct.append(f"localhost:{grpc}")
        for url in direct:
            until(f"Triton at {url} to load the models", partial(_ready, url), 180, every_s=0.5)
        config, settings = gateway_config(work / "gateway", [p.grpc for p in ports],
                                          [p.http for p in ports])
        envoy = spawn(gateway.command(config), work / "envoy.log",
                      gateway_env(settings, secrets.token_hex(16)))
        stack.callback(terminate, envoy, 5)
        through = f"localhost:{settings.grpc_port}"

        def carries() -> object:
            if envoy.poll() is not None:
                raise RuntimeError("Envoy exited: " + (work / "envoy.log").read_text()[-2000:])
            try:
                healthy = len(gateway.upstream_ports(settings.gateway_admin_port,
                                                     healthy_only=True))
            except OSError as error:  # its admin interface not up yet
                return str(error)
            return (healthy == TRITONS and _ready(through) is True) or f"{healthy} healthy"

        until("the gateway to carry calls to both Tritons", carries, 60, every_s=0.5)
        for kind, concurrency in itertools.product(KINDS, concurrencies):
            runs: dict[str, list[tuple[float, list[float], int, float, int]]] = {
                "direct": [], "gateway": []}
            for _ in range(repeats):
                for path, urls in (("direct", direct), ("gateway", [through])):
                    cpu0, retries0 = cpu_s([envoy.pid]), _retries(settings.gateway_admin_port)
                    started = time.monotonic()
                    latencies, errors = asyncio.run(_load(kind, urls, concurrency, seconds))
                    rps = len(latencies) / (time.monotonic() - started)
                    envoy_s = cpu_s([envoy.pid]) - cpu0 if path == "gateway" else 0.0
                    retries = (_retries(settings.gateway_admin_port) - retries0
                               if path == "gateway" else 0)
                    runs[path].append((rps, latencies, errors, envoy_s, retries))
            found = [_row(kind, path, concurrency, samples) for path, samples in runs.items()]
            rows += found
            print(_row_text(found), flush=True)
    return rows


def _row_text(rows: list[Row]) -> str:
    by = {r.path: r for r in rows}
    return f"  {rows[0].kind:8} c={rows[0].concurrency:<3} " + "  ".join(
        f"{r.path} {r.rps:6.0f}/s ({r.rps / by['direct'].rps:.2f}x)" for r in rows)


def table(rows: list[Row]) -> str:
    lines = ["| calls | conc | path | calls/s | x direct | p50 ms | p99 ms | Envoy CPU us/call | "
             "tries per call | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    direct = {(r.kind, r.concurrency): r.rps for r in rows if r.path == "direct"}
    for r in rows:
        lines.append(f"| {r.kind} | {r.concurrency} | {r.path} | {r.rps:.0f} | "
                     f"{r.rps / direct[(r.kind, r.concurrency)]:.2f} | {r.p50_ms:.2f} | "
                     f"{r.p99_ms:.1f} | {r.envoy_cpu_us_per_call:.0f} | "
                     f"{r.tries_per_call:.2f} | {r.errors} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> Iterator[str]:
    """Per concurrency: a sequence's call through the gateway against a plain one."""
    by = {(r.kind, r.path, r.concurrency): r for r in rows}
    for concurrency in sorted({r.concurrency for r in rows}):
        seq, plain = by.get(("sequence", "gateway", concurrency)), by.get(
            ("plain", "gateway", concurrency))
        if seq and plain:
            yield (f"c{concurrency}: Envoy CPU per sequence call {seq.envoy_cpu_us_per_call:.0f} us"
                   f", per plain call {plain.envoy_cpu_us_per_call:.0f} us "
                   f"({seq.envoy_cpu_us_per_call / max(plain.envoy_cpu_us_per_call, 1e-9):.2f}x); "
                   f"{seq.tries_per_call:.2f} tries per sequence call")


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if any(c < 1 for c in args.concurrency):
        parser.error(f"--concurrency: callers in flight, at least 1 each: {args.concurrency}")
    rows = run(args.concurrency, args.seconds, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    figures = args.out / f"sequences-{time.strftime('%Y%m%d-%H%M%S')}.json"
    figures.write_text(json.dumps({"argv": {k: str(v) for k, v in vars(args).items()},
                                   "summary": list(summary(rows)),
                                   "rows": [asdict(r) for r in rows]}, indent=1))
    out(table(rows))
    for line in summary(rows):
        out(line)
    out(f"figures: {figures}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
