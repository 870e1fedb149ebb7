"""A Triton that ends under the local stack's kubelet (local_stack/processes.py, `Supervisor`)
leaves no shared memory behind: in a pod the container's /dev/shm goes with it, here the Python
backend's regions in the machine's /dev/shm stay unless freed. Seen: a killed Triton leaves
regions of up to 515 MiB each; a day of `make test` runs left 14 GiB, and Ray's memory monitor
then killed the Serve controller in test_gateway.py's 16 MiB calls."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from local_stack.polling import until
from local_stack.ports import free_ports
from local_stack.processes import SHARED_MEMORY, TRITON_REGION_PREFIX
from local_stack.settings import TritonPorts
from local_stack.stack import server_ready
from local_stack.triton import TEST_MODELS, TritonSupervisor, command, prepare_backends


def _mapped_regions(pid: int) -> set[Path]:
    """The Python backend's regions that a process maps."""
    text = Path(f"/proc/{pid}/maps").read_text()
    return {Path(path) for path in re.findall(
        rf"\s({re.escape(str(SHARED_MEMORY))}/{TRITON_REGION_PREFIX}\S+)$", text, re.MULTILINE)}


def test_a_killed_tritons_shared_memory_is_freed(tmp_path: Path) -> None:
    models = tmp_path / "models"
    shutil.copytree(TEST_MODELS / "slow", models / "slow")
    http, grpc, metrics = free_ports(3)
    said: list[str] = []
    supervisor = TritonSupervisor(
        0, command(models, prepare_backends(tmp_path / "backends"),
                   TritonPorts(http=http, grpc=grpc, metrics=metrics), "admin-key"),
        tmp_path / "triton.log", said.append)
    supervisor.start()
    try:
        until("Triton ready", lambda: server_ready(grpc), 120, every_s=0.5)
        pid = supervisor.pid
        assert pid is not None
        regions = _mapped_regions(pid)
        assert regions and all(region.exists() for region in regions), regions
        os.kill(pid, signal.SIGKILL)
        until("the restart", lambda: sum("triton 0 started" in line for line in said) == 2, 30)
        left = sorted(str(region) for region in regions if region.exists())
        assert left == [], f"a killed Triton's shared memory stays: {left}"
    finally:
        supervisor.stop(grace_s=10)


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
