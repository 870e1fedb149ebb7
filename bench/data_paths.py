"""`make bench`: what each data path costs against Triton directly, in one run.

For each mode asked for (the gateway, the Serve path, or one of the Serve path's ingress
variants), starts the local stack (real Triton, real Serve, real Envoy), then for every protocol,
request size and concurrency alternates direct-Triton and through-the-path measurements with the
same client (tritonclient.grpc.aio; tritonclient.http.aio for Triton's HTTP API: small JSON and
1 MiB binary tensors), repeated so that machine noise cancels; with the gateway's TLS
(gateway-tls), also a Triton serving gRPC with its own TLS. Prints a table (req/s,
p50, p99, ratio to direct), the CPU seconds per 1000 requests spent by Envoy, by Ray's processes,
by Triton and by the client, and how busy the machine's cores were (on a machine where all of
them share the cores, a path whose cells run at 100% is CPU-bound: its ratio is the ratio of
CPU per call), writes the figures as JSON and a PNG plot, and stops everything it started.

    python -m bench.data_paths [--modes gateway serve classic ...] [--protocols grpc http]
                               [--seconds 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import ssl
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc
import tritonclient.http as httpclient
import tritonclient.http.aio as http_aio
from tritonclient.utils import InferenceServerException

from bench.calls import RESULTS, SIZES, Measured, cpu_s, measure_grpc, timed
from local_stack import triton
from local_stack.harness import TLS_LINE, RunningStack, StackProcess, running_stack
from local_stack.ray_cluster import replicas

# The stack's environment per mode: "gateway" (the default data path) and "serve" (Serve's
# classic gRPC proxy talking gRPC to the replicas, serve/ray-env.env); the others are the
# Serve path's ingress variants measured before the gateway existed.
SERVE_MODES: dict[str, dict[str, str]] = {
    "serve": {},
    "classic": {"RAY_SERVE_PROXY_USE_GRPC": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                "RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"},
    "classic-grpc": {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                     "RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"},
    "direct-throughput": {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
}
MODES: dict[str, dict[str, str]] = {
    "gateway": {"DATA_PATH": "gateway"},
    # The gateway with TLS on its client ports (components/tls), against Triton in clear.
    "gateway-tls": {"DATA_PATH": "gateway", "TLS": "1"},
    **{name: {"DATA_PATH": "serve", **env} for name, env in SERVE_MODES.items()},
}
# Modes measured on fewer cells than asked for: what TLS costs shows on these.
MODE_CELLS: dict[str, tuple[set[str], set[str], set[int]]] = {
    "gateway-tls": ({"grpc"}, {"small", "1MiB"}, {1, 8}),
}
# HTTP: a small request as JSON (how curl scripts and probes call), 1 MiB as binary tensors.
HTTP_SIZES = ("small", "1MiB")
# Each protocol's client ports: Triton's own, and the clients' endpoint of the data path.
PORTS = {"grpc": ("TRITON_GRPC_PORT", "GRPC_PORT"), "http": ("TRITON_HTTP_PORT", "HTTP_PORT")}


@dataclass
class Cell:
    mode: str
    protocol: str
    size: str
    concurrency: int
    # "direct", "through" (the mode's data path), "replica" (its own port) or "direct-tls"
    # (a Triton of its own serving gRPC with TLS, Triton's --grpc-use-ssl)
    path: str
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    envoy_cpu_s_per_1k: float
    ray_cpu_s_per_1k: float
    triton_cpu_s_per_1k: float
    client_cpu_s_per_1k: float  # this process: the calls' client
    machine_busy: float  # share of all cores busy while the cell ran (1.0: CPU-bound)


def _http_inputs(size: str) -> tuple[str, list[httpclient.InferInput]]:
    if SIZES[size] == 0:
        data = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for each in inputs:
            each.set_data_from_numpy(data, binary_data=False)
        return "simple", inputs
    values = np.ones(SIZES[size] // 4, dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT", [values.size], "FP32")]
    inputs[0].set_data_from_numpy(values, binary_data=True)
    return "identity_fp32", inputs


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def _busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of all cores busy between two `_machine_ticks` readings."""
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def _wait_until_quiet(timeout_s: float = 90, busy_below: float = 0.25) -> None:
    """Polls until the cores are mostly idle: a stack that just printed `ready` still spends
    seconds of CPU settling (Serve's controller, Ray's agents), which would slow the first
    cells of whichever path ran then."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    before = _machine_ticks()
    while time.monotonic() < deadline and quiet < 3:
        time.sleep(1)
        after = _machine_ticks()
        quiet = quiet + 1 if _busy_share(before, after) < busy_below else 0
        before = after
    if quiet < 3:
        print(f"  the machine stayed busier than {busy_below:.0%} for {timeout_s:.0f} s; "
              "measuring anyway", flush=True)


@dataclass
class Sample:
    """One timed run of one cell's path."""

    rps: float
    latencies: list[float]
    errors: int
    envoy_cpu_s: float
    ray_cpu_s: float
    triton_cpu_s: float
    client_cpu_s: float
    machine_busy: float


async def _measure_http(url: str, size: str, concurrency: int, seconds: float,
                        ca: Path | None = None) -> Measured:
    model, inputs = _http_inputs(size)
    binary = SIZES[size] > 0
    outputs = [httpclient.InferRequestedOutput("OUTPUT", binary_data=True)] if binary else None
    client = http_aio.InferenceServerClient(
        url, conn_limit=concurrency, ssl=ca is not None,
        ssl_context=ssl.create_default_context(cafile=str(ca)) if ca else None)
    try:
        return await timed(lambda: client.infer(model, inputs, outputs=outputs),
                            concurrency, seconds)
    finally:
        await client.close()


MEASURE = {"grpc": measure_grpc, "http": _measure_http}


@contextmanager
def _triton_with_tls(running: RunningStack, ca: Path) -> Iterator[tuple[str, int]]:
    """A second Triton on the stack's models serving gRPC with TLS (the stack's server
    certificate, signed by `ca`), as a site without a gateway would: its address and pid."""
    server = ca.parent.parent / "server"

    def ready(url: str) -> object:
        client = tc.InferenceServerClient(url, ssl=True, root_certificates=str(ca))
        try:
            return bool(client.is_model_ready("identity_fp32")) or "models loading"
        except InferenceServerException as error:
            return str(error)
        finally:
            client.close()

    tls = ("--grpc-use-ssl=true", f"--grpc-server-cert={server / 'tls.crt'}",
           f"--grpc-server-key={server / 'tls.key'}")
    with tempfile.TemporaryDirectory(prefix="sonic-ray-bench-") as directory:
        work = Path(directory)
        with triton.lone(running.model_repository, triton.prepare_backends(work / "backends"),
                         work / "triton-tls.log", ready, tls) as running_triton:
            yield running_triton


def run_mode(mode: str, protocols: list[str], sizes: list[str], concurrencies: list[int],
             seconds: float, repeats: int) -> list[Cell]:
    with running_stack(MODES[mode]) as running, contextlib.ExitStack() as extra:
        stack = running.process
        # With TLS the clients' endpoint is called as a client of `make local TLS=1` does,
        # and beside direct Triton in clear a Triton with its own TLS is measured.
        ca = (Path(stack.wait_for_line(TLS_LINE, timeout_s=5).group(1))
              if MODES[mode].get("TLS") == "1" else None)
        tls_triton = extra.enter_context(_triton_with_tls(running, ca)) if ca else None
        sids = _sessions(stack)
        replica = _replica_grpc_port(running)
        _wait_until_quiet()
        only = MODE_CELLS.get(mode)
        cells: list[Cell] = []
        for protocol, size, concurrency in (
                (p, s, c) for p in protocols for s in sizes for c in concurrencies
                if (p == "grpc" or s in HTTP_SIZES)
                and (only is None or (p in only[0] and s in only[1] and c in only[2]))):
            direct, through = PORTS[protocol]
            # Each path: its address, the CA to trust (None: in clear), its Triton's session.
            urls = {"direct": (running.url(direct), None, sids.triton),
                    "through": (running.url(through), ca, sids.triton)}
            if replica and protocol == "grpc":
                urls["replica"] = (f"localhost:{replica}", None, sids.triton)
            if tls_triton and protocol == "grpc":
                urls["direct-tls"] = (tls_triton[0], ca, tls_triton[1])
            samples: dict[str, list[Sample]] = {path: [] for path in urls}
            for _ in range(repeats):
                for path, (url, trusted, triton_sid) in urls.items():
                    samples[path].append(whole_sample(stack.lines, functools.partial(
                        _sample, stack, protocol, size, concurrency, seconds, url, trusted,
                        triton_sid), f"{mode} {protocol} {size} c={concurrency} {path}"))
            for path, runs in samples.items():
                cells.append(_cell(mode, protocol, size, concurrency, path, runs))
            latest = {c.path: c for c in cells[-len(urls):]}
            print(f"  {mode:24} {protocol:4} {size:6} c={concurrency:<3} " + " ".join(
                f"{path} {c.rps:8.1f} req/s ({c.rps / latest['direct'].rps:4.2f})"
                for path, c in latest.items()), flush=True)
    return cells


# What the stack prints when a process it supervises ends (local_stack/processes.py, Supervisor):
# a sample across it counts the CPU of a process that is gone and misses its successor's, and
# its calls meet the restart.
EXITED = re.compile(r"exited with status")
SAMPLE_TRIES = 3


def whole_sample(lines: list[str], sample: Callable[[], Sample], what: str) -> Sample:
    """A sample during which no process of the stack ended: one that saw an end is said and
    measured again, SAMPLE_TRIES times at most, then the bench stops rather than report it."""
    def ends() -> list[str]:
        return [line for line in lines if EXITED.search(line)]

    for _ in range(SAMPLE_TRIES):
        before = len(ends())
        taken = sample()
        after = ends()
        if len(after) == before:
            return taken
        print(f"  {what}: a process of the stack ended during the sample "
              f"({after[-1].strip()}): measured again", flush=True)
    raise RuntimeError(f"{what}: a process of the stack ended during each of {SAMPLE_TRIES} "
                       "samples; no figure is given for a cell measured across restarts")


def _sample(stack: StackProcess, protocol: str, size: str, concurrency: int, seconds: float,
            url: str, trusted: Path | None, triton_sid: int) -> Sample:
    """One path's calls for `seconds`, and the CPU each part spent on them."""
    sids = _sessions(stack)  # the sessions now: a restarted process's successor's too
    env0, ray0 = cpu_s(sids.envoy), cpu_s(sids.ray)
    tri0, own0, machine0 = cpu_s([triton_sid]), _own_cpu_s(), _machine_ticks()
    started = time.monotonic()
    count, latencies, errors = asyncio.run(MEASURE[protocol](
        url, size, concurrency, seconds, trusted))
    elapsed = time.monotonic() - started
    busy = _busy_share(machine0, _machine_ticks())
    return Sample(count / elapsed, latencies, errors, cpu_s(sids.envoy) - env0,
                  cpu_s(sids.ray) - ray0, cpu_s([triton_sid]) - tri0, _own_cpu_s() - own0,
                  busy)


def _sessions(stack: StackProcess) -> Sessions:
    """Each process the stack starts leads a session of its own; the latest of each."""
    return Sessions(ray=[stack.ray_pid(),
                         *stack.pids(r"pod \d+: Ray node started \(pid (\d+)\)")],
                    envoy=stack.pids(r"Envoy started \(pid (\d+)\)"),
                    triton=stack.triton_pid())


@dataclass
class Sessions:
    """The sessions whose CPU a cell counts: Ray's processes, the Envoys, the stack's Triton."""

    ray: list[int]
    envoy: list[int]
    triton: int


def _cell(mode: str, protocol: str, size: str, concurrency: int, path: str,
          runs: list[Sample]) -> Cell:
    latencies = sorted(x for run in runs for x in run.latencies) or [float("nan")]
    done = sum(len(run.latencies) for run in runs) or 1
    return Cell(
        mode=mode, protocol=protocol, size=size, concurrency=concurrency, path=path,
        rps=statistics.median(run.rps for run in runs),
        p50_ms=1000 * latencies[len(latencies) // 2],
        p99_ms=1000 * latencies[min(len(latencies) - 1, int(len(latencies) * .99))],
        errors=sum(run.errors for run in runs),
        envoy_cpu_s_per_1k=1000 * sum(run.envoy_cpu_s for run in runs) / done,
        ray_cpu_s_per_1k=1000 * sum(run.ray_cpu_s for run in runs) / done,
        triton_cpu_s_per_1k=1000 * sum(run.triton_cpu_s for run in runs) / done,
        client_cpu_s_per_1k=1000 * sum(run.client_cpu_s for run in runs) / done,
        machine_busy=statistics.median(run.machine_busy for run in runs),
    )


def _replica_grpc_port(running: RunningStack) -> int | None:
    """The first replica's own gRPC port in direct-ingress modes: the port in Serve's
    direct-ingress gRPC range (RAY_SERVE_DIRECT_INGRESS_MIN/MAX_GRPC_PORT) on which the
    replica's process listens. (Serve's `target_groups` list the proxy's port, HAProxy's in
    HAProxy mode, not the replicas'.)"""
    ports = running.ports
    try:
        found = replicas(f"http://127.0.0.1:{ports['RAY_DASHBOARD_PORT']}", running.ray_token)
        pid = int(found[0]["pid"])
    except (OSError, KeyError, IndexError, TypeError, ValueError):
        return None
    low = int(ports.get("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", "40000"))
    high = int(ports.get("RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT", "41000"))
    listening = [port for port in _listening_ports(pid) if low <= port <= high]
    return min(listening) if listening else None


def _listening_ports(pid: int) -> set[int]:
    """TCP ports on which process `pid` listens (its socket inodes in /proc/net/tcp*)."""
    fds = Path(f"/proc/{pid}/fd")
    inodes = set()
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table_name in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table_name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# How a row other than the data path's own is named in the table (ratios are to direct Triton
# in clear).
PATH_LABELS = {"replica": " (replica port)", "direct-tls": " (no gateway: Triton's own TLS)"}


def table(cells: list[Cell]) -> str:
    direct = {(c.mode, c.protocol, c.size, c.concurrency): c for c in cells
              if c.path == "direct"}
    lines = ["| mode | protocol | size | conc | direct req/s | path req/s | ratio | direct p50/p99 ms | "
             "path p50/p99 ms | added p50 ms | Envoy CPU s/1k | Ray CPU s/1k | "
             "Triton CPU s/1k | client CPU s/1k (direct/path) | cores busy (direct/path) | "
             "errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if c.path == "direct":
            continue
        d = direct[(c.mode, c.protocol, c.size, c.concurrency)]
        lines.append(
            f"| {c.mode}{PATH_LABELS.get(c.path, '')} | "
            f"{c.protocol} | {c.size} | "
            f"{c.concurrency} | {d.rps:.0f} | {c.rps:.0f} | "
            f"{c.rps / d.rps:.2f} | {d.p50_ms:.2f}/{d.p99_ms:.1f} | {c.p50_ms:.2f}/{c.p99_ms:.1f} | "
            f"{c.p50_ms - d.p50_ms:.2f} | {c.envoy_cpu_s_per_1k:.2f} | "
            f"{c.ray_cpu_s_per_1k:.2f} | {c.triton_cpu_s_per_1k:.2f} | "
            f"{d.client_cpu_s_per_1k:.2f}/{c.client_cpu_s_per_1k:.2f} | "
            f"{d.machine_busy:.0%}/{c.machine_busy:.0%} | {c.errors + d.errors} |")
    return "\n".join(lines)


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    direct = {(c.mode, c.protocol, c.size, c.concurrency): c.rps for c in cells
              if c.path == "direct"}
    serve = [c for c in cells if c.path == "through"]
    modes = sorted({c.mode for c in serve})
    labels = sorted({(c.protocol, c.size, c.concurrency) for c in serve},
                    key=lambda k: (k[0], SIZES[k[1]], k[2]))
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.1), 4))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        ratios = [next((c.rps / direct[(mode, p, s, k)] for c in serve
                        if (c.mode, c.protocol, c.size, c.concurrency) == (mode, p, s, k)), 0)
                  for p, s, k in labels]
        ax.bar([x + i * width for x in range(len(labels))], ratios, width, label=mode)
    ax.axhline(0.75, color="black", linestyle="--", label="gateway target at c8 (0.75x)")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels([f"{p} {s}\nc={k}" for p, s, k in labels])
    ax.set_ylabel("through the data path / direct Triton (req/s)")
    ax.set_title("Cost of each data path (same run, same client)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["gateway", "serve"], choices=sorted(MODES))
    parser.add_argument("--protocols", nargs="+", default=list(PORTS), choices=list(PORTS))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    cells: list[Cell] = []
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for mode in args.modes:
        print(f"mode {mode}: starting the stack", flush=True)
        cells += run_mode(mode, args.protocols, args.sizes, args.concurrency, args.seconds,
                          args.repeats)
        # Written after every mode, so that an interrupted run keeps what it measured.
        (RESULTS / f"bench-{stamp}.json").write_text(json.dumps(
            {"argv": vars(args), "cells": [asdict(c) for c in cells]}, indent=1))
    plot(cells, RESULTS / f"bench-{stamp}.png")
    print(table(cells))
    print(f"figures: {RESULTS / f'bench-{stamp}.json'}, plot: {RESULTS / f'bench-{stamp}.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
