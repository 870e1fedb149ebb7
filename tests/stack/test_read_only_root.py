"""The pods' `readOnlyRootFilesystem: true` (base/rayservice.yaml), tried on this machine: the
whole stack (Ray, Serve's proxy and replica, Triton with its python backend) runs in a mount
namespace whose root filesystem is read-only, with only what the pods mount writable: /tmp
(the emptyDir) and /dev/shm. HOME is the read-only root, as /home/ray is in the pod, and
the models come from the repository's own read-only directory, as from CVMFS."""

from __future__ import annotations

import queue
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc

from local_stack.harness import RunningStack, processes_left_behind, running_stack
from local_stack.triton import EXAMPLE_MODELS
from local_stack.triton_inputs import simple_inputs, tensor

READ_ONLY_ROOT = [
    # A user namespace of its own: needs no privilege, so CI runs it as any user.
    "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", "sh", "-c",
    # /tmp made a mount of its own first stays writable (the pods' emptyDir); so does /dev/shm.
    'mount --bind /tmp /tmp && mount -o remount,bind,ro / && exec "$@"',
    "read-only-root",
]


@pytest.fixture(scope="module")
def read_only_stack() -> Iterator[RunningStack]:
    probe = subprocess.run([*READ_ONLY_ROOT, "true"], capture_output=True, text=True)
    assert probe.returncode == 0, f"no mount namespace with a read-only root: {probe.stderr}"
    with running_stack({"HOME": "/", "MODEL_REPOSITORY": str(EXAMPLE_MODELS)},
                       wrapper=READ_ONLY_ROOT) as running:
        yield running
    assert running.process.process.returncode == 0
    assert not processes_left_behind(running.process)


def _root_options(pid: int) -> str:
    """The mount options of `/` as process `pid` sees it."""
    for line in Path(f"/proc/{pid}/mounts").read_text().splitlines():
        _, target, _, options, *_ = line.split()
        if target == "/":
            return options
    raise AssertionError(f"no / in /proc/{pid}/mounts")


def test_the_stack_serves_with_a_read_only_root(read_only_stack: RunningStack) -> None:
    options = _root_options(read_only_stack.process.ray_pid())
    assert options.split(",")[0] == "ro", "the stack did not run on a read-only root"
    workdir = read_only_stack.process.workdir()

    client = tc.InferenceServerClient(read_only_stack.url("GRPC_PORT"))
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = client.infer("simple", simple_inputs(data, np.ones_like(data)), client_timeout=60)
    assert (result.as_numpy("OUTPUT0") == data + 1).all()

    replies: queue.Queue[object] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put(error or result))
    try:
        client.async_stream_infer("repeat_int32", [
            tensor("IN", np.array([4, 2, 0], np.int32), "INT32"),
            tensor("DELAY", np.zeros(3, np.uint32), "UINT32"),
            tensor("WAIT", np.zeros(1, np.uint32), "UINT32")])
        got = [replies.get(timeout=60) for _ in range(3)]
    finally:
        client.stop_stream()
    assert [int(r.as_numpy("OUT")[0]) for r in got] == [4, 2, 0]  # type: ignore[attr-defined]

    # Nothing failed quietly on the way: no component logged a write refused by the root.
    logs = [p for pattern in ("*.log", "*.err", "*.out") for p in workdir.rglob(pattern)
            if p.is_file()]
    assert any(p.name == "triton-0.log" for p in logs) and len(logs) > 5, logs
    for path in logs:
        text = path.read_text(errors="replace")
        assert "Read-only file system" not in text, f"{path}: a write to the root filesystem"
