"""A real Triton without Docker: the server binary and python backend that the PyPI wheel
nvidia-pytriton ships, laid out as tritonserver expects (../shared/reference/NOTES.md)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TritonPorts:
    http: int
    grpc: int
    metrics: int


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


# Triton refuses these RPC groups unless the request carries the admin header with the key:
# defence in depth behind the forwarder's own refusals (serve/triton_forwarder/access.py).
RESTRICTED = "model-repository,shared-memory,trace,logging"


def command(model_repository: Path, backends: Path, ports: TritonPorts, admin_key: str,
            extra_args: tuple[str, ...] = ()) -> list[str]:
    binary = _wheel_root() / "tritonserver" / "bin" / "tritonserver"
    return [
        str(binary),
        f"--model-repository={model_repository}",
        f"--backend-directory={backends}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--exit-timeout-secs=10",
        f"--grpc-restricted-protocol={RESTRICTED}:sonic-ray-admin={admin_key}",
        f"--http-restricted-api={RESTRICTED}:sonic-ray-admin={admin_key}",
        *extra_args,
    ]


def environment() -> dict[str, str]:
    # The stub needs the libcudart bundled with the wheel even on CPU.
    libs = _wheel_root().parent / "nvidia_pytriton.libs"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        part for part in (str(libs), env.get("LD_LIBRARY_PATH", "")) if part
    )
    return env
