"""One real stack (Triton from the nvidia-pytriton wheel, Ray Serve, the forwarder) per test
session, on ports of its own so that a running `make local` is left alone."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.local_stack_process import StackProcess, processes_left_behind, running_stack

MESSAGE_LIMIT = 300 << 20
ADMIN_KEY = "test-admin-key"
ADMIN_METADATA = (("triton-grpc-protocol-sonic-ray-admin", ADMIN_KEY),)


@dataclass
class Stack:
    process: StackProcess
    serve_url: str
    triton_url: str
    model_repository: Path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "disruptive: kills part of the shared stack; runs after the other tests"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("disruptive") is not None)


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    with running_stack({
        "TRITON_ARGS": "--grpc-header-forward-pattern=x-sonic-.*",
        # A size limit that a test can exceed without sending 2 GiB (see test_faults.py).
        "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MESSAGE_LIMIT),
        "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(MESSAGE_LIMIT),
        # Known to the tests, to call Triton's restricted RPCs directly for comparison.
        "SONIC_RAY_ADMIN_KEY": ADMIN_KEY,
    }) as running:
        yield Stack(running.process, running.url("GRPC_PORT"), running.url("TRITON_GRPC_PORT"),
                    running.model_repository)
    code = running.process.process.returncode
    assert code == 0, f"the local stack exited with {code} on SIGTERM"
    left = processes_left_behind(running.process)
    assert not left, f"processes left behind after SIGTERM: {left}"
