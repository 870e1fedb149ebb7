"""One real stack (Triton from the nvidia-pytriton wheel, Ray Serve, the forwarder) per test
session, on ports of its own so that a running `make local` is left alone."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.local_stack_process import (
    EXAMPLE_MODELS,
    TEST_MODELS,
    StackProcess,
    leftover_processes,
    merged_model_repository,
    stack_ports_env,
)

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
    repo = merged_model_repository([EXAMPLE_MODELS, TEST_MODELS])
    ports = stack_ports_env()
    process = StackProcess(
        {
            **ports,
            "MODEL_REPOSITORY": str(repo),
            "TRITON_ARGS": "--grpc-header-forward-pattern=x-sonic-.*",
            # A size limit that a test can exceed without sending 2 GiB (see test_faults.py).
            "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MESSAGE_LIMIT),
            "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(MESSAGE_LIMIT),
            # Known to the tests, to call Triton's restricted RPCs directly for comparison.
            "SONIC_RAY_ADMIN_KEY": ADMIN_KEY,
        }
    )
    try:
        process.wait_for_line(r"\bready\b", timeout_s=420)
        yield Stack(process, f"localhost:{ports['GRPC_PORT']}",
                    f"localhost:{ports['TRITON_GRPC_PORT']}", repo)
    finally:
        code = process.stop()
        shutil.rmtree(repo, ignore_errors=True)
        assert code == 0, f"the local stack exited with {code} on SIGTERM"
        left = leftover_processes(process)
        for _ in range(20):  # killed processes may take a moment to be reaped
            if not left:
                break
            time.sleep(0.5)
            left = leftover_processes(process)
        assert not left, f"processes left behind after SIGTERM: {left}"
