"""The local stack's kubelet: a crashed Triton or Envoy is said and restarted, a stopped one
stays stopped (local_stack/processes.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from local_stack.polling import until
from local_stack.processes import Supervisor


def _crashes_once(tmp_path: Path) -> list[str]:
    """Exits 3 on its first run, then runs until stopped."""
    marker = tmp_path / "ran"
    return ["sh", "-c", f"if [ -e {marker} ]; then exec sleep 600; fi; touch {marker}; exit 3"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent's wait remains.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_crash_is_said_and_the_process_restarted(tmp_path: Path) -> None:
    said: list[str] = []
    supervisor = Supervisor("envoy", _crashes_once(tmp_path), tmp_path / "log", dict, said.append)
    supervisor.start()
    try:
        until("the restart", lambda: sum("envoy started" in line for line in said) == 2, 20)
        assert any(line.startswith("envoy exited with status 3; restarting in 1s")
                   and str(tmp_path / "log") in line for line in said), said
    finally:
        supervisor.stop(grace_s=5)


def test_stop_ends_the_process_and_nothing_restarts_it(tmp_path: Path) -> None:
    said: list[str] = []
    supervisor = Supervisor("envoy", ["sleep", "600"], tmp_path / "log", dict, said.append)
    supervisor.start()
    until("the process", lambda: supervisor.signal(0), 20)
    pid = int(said[0].split("pid ")[1].split(")")[0])
    supervisor.stop(grace_s=5)
    assert not _alive(pid)
    assert not supervisor.signal(0)
    assert [line for line in said if "started" in line] == said[:1], said
    assert not any("exited" in line for line in said), said


class _Planned(Supervisor):
    def exited_as_planned(self, code: int) -> bool:
        return code == -signal.SIGTERM


def test_a_planned_exit_restarts_without_a_crash_line(tmp_path: Path) -> None:
    said: list[str] = []
    supervisor = _Planned("triton 0", ["sleep", "600"], tmp_path / "log", dict, said.append)
    supervisor.start()
    try:
        until("the process", lambda: supervisor.signal(0), 20)
        assert supervisor.signal(signal.SIGTERM)
        until("the restart", lambda: sum("started" in line for line in said) == 2, 20)
        assert not any("exited" in line for line in said), said
    finally:
        supervisor.stop(grace_s=5)


def test_stopping_one_never_started_says_nothing_and_raises_nothing(tmp_path: Path) -> None:
    """A stack that fails before a process starts (Ray refusing its ports) stops cleanly: its
    own error stays the last word, not a traceback of its cleanup."""
    said: list[str] = []
    supervisor = Supervisor("envoy", ["sleep", "600"], tmp_path / "log", dict, said.append)
    supervisor.stop(grace_s=1)
    assert said == []


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
