"""A real Triton per simulated pod: the server binary and python backend that the PyPI wheel
nvidia-pytriton ships, laid out as tritonserver expects, restarted as the kubelet would."""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from local_stack.polling import until
from local_stack.ports import free_ports
from local_stack.processes import Supervisor, spawn
from local_stack.settings import ROOT, TritonPorts
from triton_pod.access import ADMIN_KEY_NAME

# The example models (a ConfigMap for overlays/local) and the tests' own.
EXAMPLE_MODELS = ROOT / "triton" / "models"
TEST_MODELS = ROOT / "tests" / "models"
# Stateful models (sequence batching): the sequence tests' and bench/sequences.py's.
SEQUENCE_MODELS = ROOT / "tests" / "sequence_models"


def merged_model_repository(sources: Iterable[Path]) -> Path:
    """A fresh copy of the example and test models: the slow model writes markers into it."""
    repo = Path(tempfile.mkdtemp(prefix="sonic-ray-models-"))
    for source in sources:
        for model in source.iterdir():
            if model.is_dir():
                shutil.copytree(model, repo / model.name)
    return repo


# Triton refuses these RPC groups unless the request carries the admin header with the key:
# defence in depth behind the data path's own refusals (serve/triton_pod/access.py).
RESTRICTED = "model-repository,shared-memory,trace,logging"


def _wheel_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed: run `make venv` first")
    return Path(next(iter(spec.submodule_search_locations)))


def prepare_backends(into: Path) -> Path:
    """Builds a backend directory whose python backend runs this interpreter's stub.

    The stub embeds the system's libpython and ignores PYTHONPATH, so numpy (which every
    python-backend model imports through triton_python_backend_utils) is linked in beside
    the backend files, where the stub looks first.
    """
    root = _wheel_root() / "tritonserver"
    python_dir = into / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(root / "backends" / "python" / name, python_dir / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton ships no python backend stub for Python {version}")
    shutil.copy2(stub, python_dir / stub.name)
    numpy_spec = importlib.util.find_spec("numpy")
    if numpy_spec is not None and numpy_spec.origin is not None:
        link = python_dir / "numpy"
        if not link.exists():
            link.symlink_to(Path(numpy_spec.origin).parent, target_is_directory=True)
    return into


def server_binary() -> Path:
    """The tritonserver that the nvidia-pytriton wheel ships."""
    return _wheel_root() / "tritonserver" / "bin" / "tritonserver"


def command(model_repository: Path, backends: Path, ports: TritonPorts, admin_key: str,
            extra_args: tuple[str, ...] = ()) -> list[str]:
    binary = server_binary()
    restricted = f"{RESTRICTED}:{ADMIN_KEY_NAME}={admin_key}"
    return [
        str(binary),
        f"--model-repository={model_repository}",
        f"--backend-directory={backends}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--exit-timeout-secs=10",
        f"--grpc-restricted-protocol={restricted}",
        f"--http-restricted-api={restricted}",
        *extra_args,
    ]


def environment_additions() -> dict[str, str]:
    """What this machine's Triton needs beyond a container's environment: the stub loads the
    libcudart bundled with the wheel even on CPU."""
    libs = _wheel_root().parent / "nvidia_pytriton.libs"
    return {"LD_LIBRARY_PATH": os.pathsep.join(
        part for part in (str(libs), os.environ.get("LD_LIBRARY_PATH", "")) if part)}


def environment() -> dict[str, str]:
    return {**os.environ, **environment_additions()}


@contextmanager
def lone(model_repository: Path, backends: Path, log: Path, ready: Callable[[str], object],
         extra_args: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """One Triton outside any stack (a bench's comparison): its gRPC address and pid once
    `ready(address)` returns True (anything else says why not). A Triton that exits before is
    an error with its log's tail at once, not after the wait."""
    grpc, http, metrics = free_ports(3)
    process = spawn(command(model_repository, backends,
                            TritonPorts(http=http, grpc=grpc, metrics=metrics),
                            secrets.token_hex(16), extra_args), log, environment())
    url = f"localhost:{grpc}"

    def started() -> object:
        if process.poll() is not None:
            raise RuntimeError(f"Triton exited ({process.returncode}): "
                               + log.read_text(errors="replace")[-2000:])
        return ready(url)

    try:
        until(f"Triton on {model_repository} ready", started, 120, every_s=0.5)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


class TritonSupervisor(Supervisor):
    """Runs the Triton of one simulated pod, restarted as the kubelet would. `retire` is what a
    pod deletion does to Triton: out of discovery first (`before_exit` waits for that), then
    SIGTERM, Triton finishing its calls; then a new one."""

    def __init__(self, index: int, cmd: list[str], log_path: Path,
                 say: Callable[[str], None]) -> None:
        super().__init__(f"triton {index}", cmd, log_path, environment, say)
        self.index = index
        self._retiring = threading.Event()

    @property
    def retiring(self) -> bool:
        return self._retiring.is_set()

    def exited_as_planned(self, code: int) -> bool:
        if not self._retiring.is_set():
            return False
        self._say(f"triton {self.index} exited with status {code} after its drain; "
                  "starting the pod's new Triton")
        self._retiring.clear()
        return True

    def retire(self, before_exit: Callable[[], None]) -> None:
        """Pod deletion: marks this Triton as terminating (discovery drops it), waits for
        `before_exit` (the preStop), then SIGTERM: Triton completes the calls it holds."""
        self._retiring.set()
        self._say(f"triton {self.index}: pod deleted; leaving discovery")
        before_exit()
        if self.signal(signal.SIGTERM):
            self._say(f"triton {self.index}: out of discovery; SIGTERM, draining its calls")
