"""Child processes that die with the stack, and cleanup by session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
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


_SAYING = threading.Lock()


def say_line(line: str) -> None:
    """One whole line to stdout, never run into another thread's (print writes the text and
    the newline apart): tests and operators read the stacks' lines one by one."""
    with _SAYING:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def run_until_signalled(run: Callable[[threading.Event], None], cleanup: Callable[[], None],
                        say: Callable[[str], None],
                        errors: tuple[type[Exception], ...] = ()) -> int:
    """A stack's main: `run(stop)` until it returns or SIGINT/SIGTERM sets `stop`, then
    `cleanup()`, whatever happened; 0, or 1 after an error it says."""
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        if stop.is_set():
            return  # already stopping: a second signal must not cut the cleanup short
        stop.set()
        # Interrupts whatever wait the stack is in, startup included.
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        run(stop)
        return 0
    except KeyboardInterrupt:
        return 0
    except (SystemExit, Exception) as error:
        if not isinstance(error, (SystemExit, *errors)):
            raise
        code = error.code if isinstance(error, SystemExit) else str(error)
        if code not in (None, 0):
            say(f"error: {code}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cleanup()


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


# Triton's Python backend keeps each model instance's tensors in a region of /dev/shm. In a pod
# the container's /dev/shm goes with the container; here, the machine's, a Triton that did not
# exit cleanly (killed, crashed) leaves its regions behind.
SHARED_MEMORY = Path("/dev/shm")
TRITON_REGION_PREFIX = "triton_python_backend_shm_region_"


def regions() -> set[str]:
    """The Python backend's shared-memory regions there are now."""
    return {region.name for region in SHARED_MEMORY.glob(f"{TRITON_REGION_PREFIX}*")}


def mapped_regions() -> set[str]:
    """The Python backend's regions that some live process maps now (one pass over every
    process's maps: it takes a while on a machine running Ray)."""
    mapped: set[str] = set()
    marker = f"{SHARED_MEMORY}/{TRITON_REGION_PREFIX}"
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marker in text:
            mapped.update(line.rsplit("/", 1)[1].split()[0] for line in text.splitlines()
                          if marker in line)
    return mapped


def orphaned_regions() -> list[str]:
    """The Python backend's regions that no live process maps (every live Triton and stub
    maps its own): what a container's end frees in a pod. Only regions that existed before
    the pass over the processes' maps, and that neither it nor a second pass found mapped:
    one created meanwhile belongs to a Triton starting in another pod (seen: freed in the
    middle of a KubeRay upgrade, the new cluster's Python stubs failed "Unable to initialize
    shared memory key ... No such file or directory" and its Triton never became ready)."""
    candidates = regions()
    if not candidates:
        return []
    left = candidates - mapped_regions()
    if left:
        left -= mapped_regions()
    return sorted(left)


def free_orphaned_regions() -> list[str]:
    """Removes orphaned_regions(): the names removed."""
    freed = []
    for name in orphaned_regions():
        with contextlib.suppress(FileNotFoundError):
            (SHARED_MEMORY / name).unlink()
            freed.append(name)
    return freed


def kill_session(sid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Ray's workers change process group (and HAProxy is their child): a session holds all."""
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


# A SIGKILLed process keeps its memory mapped until the kernel has torn it down, some
# milliseconds after the signal; a region freed before then looks mapped and stays.
SESSION_END_S = 10.0


def end_session(sid: int) -> None:
    """SIGKILL to a session, then waits (at most SESSION_END_S) until none of it runs: what is
    left is a zombie (state Z), which maps nothing."""
    kill_session(sid)
    deadline = time.monotonic() + SESSION_END_S
    while any(fields[0] != "Z" for fields in session_members(sid).values()):
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)


def terminate(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the child's whole session (Ray's workers are in groups of their own), then
    SIGKILL to whatever of it is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    kill_session(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    kill_session(process.pid)
    process.wait()


def spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=die_with_stack)


class Supervisor:
    """Runs a container's process and restarts it with backoff when it exits, as the kubelet
    would (restartPolicy Always): a crash is said, with its log, never hidden or fatal."""

    def __init__(self, name: str, cmd: list[str], log_path: Path,
                 env: Callable[[], dict[str, str]], say: Callable[[str], None]) -> None:
        self.name = name
        self._cmd = cmd
        self.log_path = log_path
        self._env = env
        self._say = say
        self._stopping = threading.Event()
        self._process: subprocess.Popen[bytes] | None = None
        # PR_SET_PDEATHSIG follows the thread that forks: this one lives as long as the child.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def exited_as_planned(self, code: int) -> bool:
        """Whether an exit was asked for (and says so); a subclass's planned restarts."""
        return False

    def _run(self) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            started = time.monotonic()
            self._process = spawn(self._cmd, self.log_path, self._env())
            self._say(f"{self.name} started (pid {self._process.pid}), log: {self.log_path}")
            code = self._process.wait()
            # Helpers outlive a killed parent (Triton's python stubs); a container's all go,
            # and its shared memory with them.
            end_session(self._process.pid)
            free_orphaned_regions()
            if self._stopping.is_set():
                return
            if self.exited_as_planned(code):
                backoff = 1.0
                continue
            if time.monotonic() - started > 60:
                backoff = 1.0
            self._say(f"{self.name} exited with status {code}; restarting in {backoff:.0f}s "
                      f"(last lines in {self.log_path})")
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, 30.0)

    def signal(self, signum: int) -> bool:
        """Sends `signum` to the running process; False when none runs."""
        process = self._process
        if process is None or process.poll() is not None:
            return False
        process.send_signal(signum)
        return True

    def stop(self, grace_s: float = 15, main_only: bool = False) -> None:
        """SIGTERM, then SIGKILL to what is left after `grace_s`. `main_only`: SIGTERM to the
        main process alone, as the kubelet signals a container's first process."""
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            if main_only:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(grace_s, 0))
                kill_session(process.pid)
                process.wait()
            else:
                terminate(process, grace_s=grace_s)
        if self._thread.is_alive():  # never started: nothing to wait for
            self._thread.join(timeout=max(grace_s, 0) + 5)

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None and process.poll() is None else None
