"""make local's stop (LocalStack.stop) keeps within STOP_LIMIT_S when every process it runs
ignores SIGTERM and only SIGKILL ends it: the pods' processes, Envoy, Prometheus and the
gateway's discovery are waited for together, then the head. Stopped one after the other, a
stack with Prometheus took 10 + 20 + 5 s. The processes are real; the stack around them is
stood in (the thing tested is the stop's order and budget). Every stack the tests start is held
to the same limit on its real stop, with nothing left behind (local_stack/harness.py)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from local_stack.processes import Supervisor, spawn
from local_stack.stack import STOP_LIMIT_S, LocalStack

# A process that only SIGKILL ends, in a session of its own as the stack's children are.
STUBBORN = ["bash", "-c", "trap '' TERM; while :; do sleep 0.1; done"]


def test_processes_that_ignore_sigterm_are_all_gone_within_the_limit(tmp_path: Path) -> None:
    def stubborn(name: str) -> subprocess.Popen[bytes]:
        return spawn(STUBBORN, tmp_path / f"{name}.log", {"PATH": "/usr/bin:/bin"})

    supervisors = [Supervisor(f"triton {i}", STUBBORN, tmp_path / f"triton-{i}.log",
                              lambda: {"PATH": "/usr/bin:/bin"}, lambda _: None)
                   for i in range(2)]
    for supervisor in supervisors:
        supervisor.start()
    slow_discovery = SimpleNamespace(stop=lambda: time.sleep(6))
    processes = {"prometheus": stubborn("prometheus"), "head": stubborn("head"),
                 "node0": stubborn("node0"), "node1": stubborn("node1")}
    stack: Any = SimpleNamespace(
        _stopping=SimpleNamespace(set=lambda: None), discovery=slow_discovery,
        prometheus=processes["prometheus"], envoy=None, ray=processes["head"],
        pod_nodes={0: processes["node0"], 1: processes["node1"]}, tritons=supervisors,
        workdir=tmp_path)
    began = time.monotonic()
    LocalStack.stop(stack)
    took = time.monotonic() - began
    assert all(p.poll() is not None for p in processes.values())
    assert all(s.pid is None for s in supervisors)
    assert took <= STOP_LIMIT_S, f"the stop took {took:.1f} s (limit {STOP_LIMIT_S} s)"


pytestmark = pytest.mark.processes
