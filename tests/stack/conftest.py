"""One real stack per data path and test session (Triton from the nvidia-pytriton wheel, Ray
Serve, and Envoy on the gateway path), on ports of its own so that a running `make local` is
left alone. Tests that take `stack` run against both data paths."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from local_stack.harness import RunningStack, StackProcess, processes_left_behind, running_stack
from triton_pod.access import ADMIN_HEADER

MESSAGE_LIMIT = 300 << 20
ADMIN_KEY = "test-admin-key"
ADMIN_METADATA = ((ADMIN_HEADER, ADMIN_KEY),)
DATA_PATHS = ["gateway", "serve"]


@dataclass
class Stack:
    data_path: str
    process: StackProcess
    running: RunningStack
    url: str  # the clients' endpoint: Envoy, or Serve's gRPC proxy
    triton_url: str
    model_repository: Path
    http_url: str  # the clients' HTTP endpoint: Envoy, or Serve's HTTP proxy
    triton_http_url: str


@pytest.fixture(scope="session", params=DATA_PATHS)
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    data_path: str = request.param
    with running_stack({
        "DATA_PATH": data_path,
        "TRITON_ARGS": "--grpc-header-forward-pattern=x-sonic-.*",
        # A size limit that a test can exceed without sending 2 GiB (see test_faults.py).
        "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MESSAGE_LIMIT),
        "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(MESSAGE_LIMIT),
        # Known to the tests, to call Triton's restricted RPCs directly for comparison.
        "SONIC_RAY_ADMIN_KEY": ADMIN_KEY,
        # A real Prometheus scraping the stack (tests/stack/test_observability.py).
        "OBSERVE": "1",
    }) as running:
        yield Stack(data_path, running.process, running, running.url("GRPC_PORT"),
                    running.url("TRITON_GRPC_PORT"), running.model_repository,
                    running.url("HTTP_PORT"), running.url("TRITON_HTTP_PORT"))
    code = running.process.process.returncode
    assert code == 0, f"the local stack exited with {code} on SIGTERM"
    left = processes_left_behind(running.process)
    assert not left, f"processes left behind after SIGTERM: {left}"
