"""Child processes that die with the stack, and cleanup by session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def set_parent_death_signal() -> None:
    """Has the kernel send SIGTERM when the parent dies (Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def die_with_stack() -> None:
    """Runs in a child before exec: if the stack dies without cleaning up, so does the child."""
    set_parent_death_signal()
    os.setsid()


def session_members(sid: int) -> dict[int, list[str]]:
    """The live processes of a session: pid -> the fields of /proc/<pid>/stat after the name."""
    members = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # stat field 6: the session id
            members[int(proc.name)] = fields
    return members


def kill_session(sid: int) -> None:
    """Ray's workers change process group (and HAProxy is their child): a session holds all."""
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def terminate(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the child's group, then SIGKILL to whatever of its session is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    kill_session(process.pid)
    process.wait()


def spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=die_with_stack)
