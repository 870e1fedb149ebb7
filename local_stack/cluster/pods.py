"""Pods as the kubelet runs them: each container a process in the pod's namespace, restarted
when it exits; startup and readiness probes on their periods and thresholds; and on deletion
the pod turns terminating (out of every Service's endpoints), each container's preStop runs,
then SIGTERM to the container's main process, and SIGKILL to whatever is left when the grace
period (counted from the deletion, preStop included) ends."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from local_stack.cluster.manifests import Probe
from local_stack.cluster.network import PodNetwork
from local_stack.processes import Supervisor


@dataclass
class ContainerSpec:
    name: str
    cmd: list[str]
    env: dict[str, str]
    readiness: Probe | None
    startup: Probe | None
    prestop: tuple[str, ...] | None


class _ProbeState:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.next_at = time.monotonic() + probe.initial_delay_s
        self.successes = 0
        self.failures = 0
        self.passed = False


def last_line(log: Path, limit: int = 200) -> str:
    """A log's last non-empty line, at most `limit` characters of it."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = [line for line in f.read().decode(errors="replace").splitlines()
                     if line.strip()]
    except OSError as error:
        return f"(unreadable: {error})"
    return lines[-1][:limit] if lines else "(empty)"


def probe_once(probe: Probe, pod: PodNetwork) -> bool:
    """One run of a probe against the pod, as the kubelet runs it."""
    try:
        if probe.kind == "http":
            url = f"http://{pod.ip}:{probe.port}{probe.path}"
            with urllib.request.urlopen(url, timeout=probe.timeout_s) as response:
                status: int = response.status
                return 200 <= status < 400
        if probe.kind == "tcp":
            with socket.create_connection((pod.ip, probe.port), timeout=probe.timeout_s):
                return True
        done = subprocess.run([*pod.exec_prefix(), *probe.command], capture_output=True,
                              timeout=probe.timeout_s, check=False)
        return done.returncode == 0
    except (urllib.error.URLError, OSError, subprocess.TimeoutExpired, ValueError):
        return False


def _constant(env: dict[str, str]) -> Callable[[], dict[str, str]]:
    return lambda: env


class Pod:
    def __init__(self, name: str, network: PodNetwork, containers: list[ContainerSpec],
                 grace_s: float, workdir: Path, say: Callable[[str], None],
                 on_change: Callable[[], None]) -> None:
        self.name = name
        self.network = network
        self.grace_s = grace_s
        self.created_at = time.monotonic()
        self.dir = workdir / "pods" / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self._say = say
        self._on_change = on_change
        self.specs = {c.name: c for c in containers}
        self.containers = {
            c.name: Supervisor(f"{name}/{c.name}", [*network.exec_prefix(), *c.cmd],
                               workdir / f"{name}.{c.name}.log", _constant(c.env), say)
            for c in containers}
        self._startup = {c.name: _ProbeState(c.startup) for c in containers if c.startup}
        self._readiness = {c.name: _ProbeState(c.readiness) for c in containers if c.readiness}
        self.terminating = False
        self.gone = threading.Event()
        self._ready = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, name=f"{name} probes",
                                        daemon=True)

    @property
    def ip(self) -> str:
        return self.network.ip

    @property
    def ready(self) -> bool:
        """What the endpoints controller reads: every container ready, not terminating."""
        return self._ready and not self.terminating

    def waiting_on(self) -> str:
        """What keeps the pod from ready, for a message: each probe not passed, its failures
        in a row, and its container's last log line."""
        parts = []
        for kind, states in (("startup", self._startup), ("readiness", self._readiness)):
            for name, state in states.items():
                if not state.passed:
                    parts.append(f"{name}'s {kind} probe not passed ({state.failures} failures "
                                 f"in a row), its log ends: "
                                 f"{last_line(self.containers[name].log_path)!r}")
        return "; ".join(parts) or "every probe passed"

    def start(self) -> None:
        for container in self.containers.values():
            container.start()
        self._thread.start()

    def _probe_loop(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            for name, state in [*self._startup.items(), *self._readiness.items()]:
                startup = name in self._startup and state is self._startup[name]
                if startup and state.passed:
                    continue
                if not startup and name in self._startup and not self._startup[name].passed:
                    continue  # readiness waits for the startup probe
                if now < state.next_at:
                    continue
                state.next_at = now + state.probe.period_s
                self._probe(name, state, startup)
            ready = all(s.passed for s in self._readiness.values()) and all(
                s.passed for s in self._startup.values())
            if ready != self._ready:
                self._ready = ready
                self._say(f"{self.name}: {'ready' if ready else 'not ready'}")
                self._on_change()

    def _probe(self, container: str, state: _ProbeState, startup: bool) -> None:
        if probe_once(state.probe, self.network):
            state.successes, state.failures = state.successes + 1, 0
            if state.successes >= state.probe.success_threshold:
                state.passed = True
            return
        state.successes, state.failures = 0, state.failures + 1
        if state.failures >= state.probe.failure_threshold:
            state.passed = False
            if startup:
                # A container that never starts is killed and started again.
                state.failures = 0
                self._say(f"{self.name}/{container}: startup probe failed; restarting it")
                pid = self.containers[container].pid
                if pid is not None:
                    self.containers[container].signal(9)

    def delete(self) -> None:
        """What `kubectl delete pod` does, in the kubelet's order; returns once it is gone."""
        if self.terminating:
            return
        self.terminating = True
        deadline = time.monotonic() + self.grace_s
        self._say(f"{self.name}: deleted; terminating (grace period {self.grace_s:.0f}s)")
        self._on_change()
        threads = [threading.Thread(target=self._stop_container, args=(name, deadline),
                                    daemon=True) for name in self.containers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._stop.set()
        self._say(f"{self.name}: gone")
        self.gone.set()

    def _stop_container(self, name: str, deadline: float) -> None:
        spec = self.specs[name]
        if spec.prestop:
            started = time.monotonic()
            try:
                subprocess.run([*self.network.exec_prefix(), *spec.prestop],
                               env=spec.env, capture_output=True, check=False,
                               timeout=max(deadline - started, 0.1))
                self._say(f"{self.name}/{name}: preStop done after "
                          f"{time.monotonic() - started:.1f}s; SIGTERM")
            except subprocess.TimeoutExpired:
                self._say(f"{self.name}/{name}: preStop still running when the grace period "
                          "ended")
        self.containers[name].stop(grace_s=deadline - time.monotonic(), main_only=True)

    def kill(self) -> None:
        """The stack stopping: no grace."""
        self.terminating = True
        self._stop.set()
        for container in self.containers.values():
            container.stop(grace_s=0, main_only=True)
        self.gone.set()
