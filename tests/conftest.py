"""The marker set by folder: tests/stack/ and tests/cluster/ start real stacks (make unit leaves
them out);
disruptive tests (they kill part of a shared stack) run after the others."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Folders whose tests start stacks (make local's, or make cluster's).
STACK_FOLDERS = (HERE / "stack", HERE / "cluster")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "disruptive: kills part of the shared stack; runs after the other tests"
    )
    config.addinivalue_line("markers", "stack: needs a running stack (the tests in tests/stack/)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(folder in item.path.parents for folder in STACK_FOLDERS):
            item.add_marker(pytest.mark.stack)
    items.sort(key=lambda item: item.get_closest_marker("disruptive") is not None)
