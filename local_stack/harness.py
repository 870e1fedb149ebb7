"""Runs `make local`'s stack as a child process on ports of its own and follows what it
prints: the one harness of the tests and `make bench`."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from local_stack.polling import until
from local_stack.ports import free_port_range, free_ports, release
from local_stack.processes import orphaned_regions, regions
from local_stack.ray_cluster import application, deploy, deployment_of
from local_stack.settings import DEFAULT_CONFIG, POD_PORT_STEP, ROOT, Settings
from local_stack.stack import READY, SAID, STOP_LIMIT_S
from local_stack.triton import EXAMPLE_MODELS, TEST_MODELS, merged_model_repository

REPLICA_PORTS = 16  # per stack and protocol: more than any test's replicas
MAX_PODS = 4  # Triton port blocks reserved per stack
# The stack's own `ready` line, anchored: a traceback it prints may name `ProxyActor.ready()`.
READY_LINE = f"^{re.escape(f'{SAID} {READY}')} "
# With TLS=1, the line naming the files a client calls with (make local's contract):
# groups 1-3 the CA, the client's certificate and its key.
TLS_LINE = rf"^{re.escape(SAID)} tls: ca (\S+) client-cert (\S+) client-key (\S+)$"


# The ranges a stack of its own takes: the variable naming each one's first port, its length.
# Triton i of a stack listens on each base port + 10 i: blocks of 10 ports, one per pod.
# Direct-ingress replicas' own servers, a range per stack: gRPC binds with SO_REUSEPORT, so
# two stacks' replicas on one port would silently share its connections.
PORT_RANGES = {"TRITON_HTTP_PORT": POD_PORT_STEP * MAX_PODS,
               "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": REPLICA_PORTS,
               "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": REPLICA_PORTS}


def stack_ports_env() -> dict[str, str]:
    """Ports of a stack of its own, clear of `make local`'s and of any other stack's."""
    names = ["GRPC_PORT", "HTTP_PORT", "SERVE_GRPC_PORT", "SERVE_HTTP_PORT", "GATEWAY_METRICS_PORT",
             "GATEWAY_ADMIN_PORT", "ADMISSION_PORT", "PROMETHEUS_PORT", "RAY_GCS_PORT",
             "RAY_DASHBOARD_PORT",
             "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
             "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"]
    ports = {name: str(port) for name, port in zip(names, free_ports(len(names)), strict=True)}
    first = {name: free_port_range(length) for name, length in PORT_RANGES.items()}
    triton = first["TRITON_HTTP_PORT"]
    for offset, name in enumerate(("TRITON_HTTP_PORT", "TRITON_GRPC_PORT", "TRITON_METRICS_PORT",
                                   "POD_READY_PORT")):
        ports[name] = str(triton + offset)
    for protocol in ("HTTP", "GRPC"):
        name = f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT"
        ports[name] = str(first[name])
        ports[f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT"] = str(
            first[name] + PORT_RANGES[name] - 1)
    return ports


def release_stack_ports(ports: dict[str, str]) -> None:
    """What stack_ports_env handed out, free again once the stack stopped clean."""
    numbers = [int(v) for v in ports.values() if v.isdigit()]
    for name, length in PORT_RANGES.items():
        numbers += range(int(ports[name]), int(ports[name]) + length)
    release(numbers)


class StackProcess:
    def __init__(self, env: dict[str, str], wrapper: Sequence[str] = (),
                 module: str = "local_stack") -> None:
        self.env = env
        self.lines: list[str] = []
        self.finished = False
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            [*wrapper, sys.executable, "-m", module],
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            sys.stderr.write(f"[stack] {line}")
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.finished = True
            self._changed.notify_all()

    def wait_for_line(self, pattern: str, timeout_s: float, after: int = 0) -> re.Match[str]:
        """The first line from index `after` on that matches; fails if the stack exits."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for line in self.lines[after:]:
                    match = regex.search(line)
                    if match:
                        return match
                if self.finished:
                    raise RuntimeError(
                        f"the local stack exited ({self.process.returncode}) before printing "
                        f"{pattern!r}:\n" + "\n".join(self.lines[-40:])
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"no line matching {pattern!r} within {timeout_s}s:\n"
                        + "\n".join(self.lines[-40:])
                    )
                self._changed.wait(min(remaining, 1.0))

    def pids(self, pattern: str) -> list[int]:
        """Every pid the stack printed in lines matching `pattern` (one group: the pid)."""
        return [int(m.group(1)) for line in self.lines if (m := re.search(pattern, line))]

    def _pid(self, pattern: str) -> int:
        return self.pids(pattern)[-1]

    def triton_pid(self, pod: int = 0) -> int:
        return self._pid(rf"triton {pod} started \(pid (\d+)\)")

    def ray_pid(self) -> int:
        return self._pid(r"starting Ray \(pid (\d+)")

    def workdir(self) -> Path:
        """The stack's work directory: its Ray session (logs included) and Triton's log."""
        return Path(self.wait_for_line(r"log: (\S+)/ray\.log", 1).group(1))

    def delete_pod(self, pod: int) -> None:
        """What `kubectl delete pod` does to that pod's Triton (local_stack/stack.py)."""
        (self.workdir() / "pods" / str(pod) / "delete").touch()

    def stop(self, timeout_s: float = 90) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()


@dataclass
class RunningStack:
    process: StackProcess
    ports: dict[str, str]
    model_repository: Path
    ray_token: str

    def url(self, port_name: str) -> str:
        return f"localhost:{self.ports[port_name]}"

    def triton_url(self, pod: int) -> str:
        return f"localhost:{int(self.ports['TRITON_GRPC_PORT']) + POD_PORT_STEP * pod}"

    def redeploy(self, serve_config: Path, timeout_s: float = 180) -> None:
        """Deploys another Serve config in place, with this stack's ports, as KubeRay applies a
        changed serveConfigV2, and returns once Serve has rolled it out: a replica of the old
        config may otherwise still take (and refuse, by its old limits) the next calls."""
        dashboard = f"http://127.0.0.1:{self.ports['RAY_DASHBOARD_PORT']}"
        before = application(dashboard, self.ray_token).get("last_deployed_time_s")
        deploy(Settings.from_env({**os.environ, **self.process.env,
                                  "SERVE_CONFIG": str(serve_config)}))

        def rolled_out() -> object:
            app = application(dashboard, self.ray_token)
            if app.get("last_deployed_time_s") == before:
                return "the old config still deployed"
            state = (app.get("status"), deployment_of(app).get("status"))
            return state == ("RUNNING", "HEALTHY") or (
                f"application {state[0]}, deployment {state[1]}")

        until(f"Serve to roll out {serve_config}", rolled_out, timeout_s, every_s=0.5)

    def triton_metrics_url(self, pod: int) -> str:
        port = int(self.ports["TRITON_METRICS_PORT"]) + POD_PORT_STEP * pod
        return f"http://localhost:{port}/metrics"


@contextmanager
def running_stack(env: dict[str, str], wrapper: Sequence[str] = (),
                  ready_pattern: str = READY_LINE) -> Iterator[RunningStack]:
    """A stack on ports of its own with a fresh copy of the example and test models, started
    (under `wrapper`, a command that execs its arguments) until `ready` and stopped with
    SIGTERM afterwards (its exit status is in `process.process.returncode`)."""
    repo = merged_model_repository([EXAMPLE_MODELS, TEST_MODELS])
    ports = stack_ports_env()
    # Ray's token: the stack turns Ray's token authentication on; the tests call its dashboard.
    token = secrets.token_hex(32)
    # Its pre-warm directory named, so that a redeploy points the policy at the same one.
    prewarm = Path(tempfile.mkdtemp(prefix="sonic-ray-prewarm-"))
    process = StackProcess({**ports, "MODEL_REPOSITORY": str(repo), "RAY_AUTH_TOKEN": token,
                            "PREWARM_DIR": str(prewarm), **env}, wrapper)
    ready = False
    # Regions there before (another stack's, live or leaked) are not this stack's to answer for.
    regions_before = regions()
    try:
        process.wait_for_line(READY_LINE, timeout_s=420)
        process.wait_for_line(ready_pattern, timeout_s=300)
        ready = True
        yield RunningStack(process, ports, repo, token)
    finally:
        began = time.monotonic()
        process.stop()
        took = time.monotonic() - began
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(prewarm, ignore_errors=True)
    # Every stack the tests start keeps make local's promise on its stop.
    if ready:
        problems = stop_problems(process, ports, took, regions_before)
        if not problems:
            release_stack_ports(ports)
        if problems:
            raise AssertionError(f"make local with {sorted(env)} did not stop clean: "
                                 + "; ".join(problems))


def stop_problems(process: StackProcess, ports: dict[str, str], took_s: float,
                  regions_before: set[str]) -> list[str]:
    """What breaks make local's promise on a stop: within STOP_LIMIT_S of SIGTERM, leaving no
    process, no listening port and no shared memory of its Tritons behind."""
    problems = []
    if took_s > STOP_LIMIT_S:
        said = [line for line in process.lines if "stopped in" in line]
        problems.append(f"stopped {took_s:.1f} s after SIGTERM (limit {STOP_LIMIT_S} s; "
                        f"{said[-1] if said else 'it never said stopped'})")
    left = processes_left_behind(process)
    if left:
        problems.append(f"processes left: {left}")
    listening = listening_ports()
    held = [f"{name}={port}" for name, port in sorted(ports.items()) if int(port) in listening]
    if held:
        problems.append(f"ports still listening: {held}")
    regions = sorted(set(orphaned_regions()) - regions_before)
    if regions:
        problems.append(f"shared memory left in /dev/shm: {regions}")
    return problems


def listening_ports() -> set[int]:
    """Every TCP port something on this machine listens on (/proc/net/tcp and tcp6, state
    0A): a closed connection's TIME_WAIT or FIN_WAIT on a port does not count."""
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def serve_config_with(directory: Path, deployment: dict[str, Any] | None = None,
                      autoscaling: dict[str, Any] | None = None,
                      policy_kwargs: dict[str, Any] | None = None,
                      args: dict[str, Any] | None = None) -> Path:
    """serve/serve-config.yaml with some settings of its one deployment (and of its
    application's `args`) changed, written into `directory`: the tests' Serve configs are
    derived from the real one, never copied."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    (app,) = config["applications"]
    app["args"].update(args or {})
    (settings,) = app["deployments"]
    settings.update(deployment or {})
    settings["autoscaling_config"].update(autoscaling or {})
    settings["autoscaling_config"]["policy"]["policy_kwargs"].update(policy_kwargs or {})
    path = directory / "serve-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def processes_left_behind(stack: StackProcess, wait_s: float = 10) -> list[str]:
    """What of the stack still runs after it stopped; killed processes take a moment to go."""
    deadline = time.monotonic() + wait_s
    left = leftover_processes(stack)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = leftover_processes(stack)
    return left


def leftover_processes(stack: StackProcess) -> list[str]:
    """Processes still running whose command line names the stack's work directory."""
    workdirs = {m.group(1) for line in stack.lines
                if (m := re.search(r"(/[^ ]*/sonic-ray-[^/ ]+)/", line))}
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(workdir in cmdline for workdir in workdirs):
            left.append(f"{proc.name}: {cmdline[:120]}")
    return left
