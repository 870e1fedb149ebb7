"""The marker set by folder: tests/stack/ and tests/cluster/ start real stacks (make unit leaves
them out);
disruptive tests (they kill part of a shared stack) run after the others that share it."""

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
    items[:] = disruptive_last(items)


def _shared(item: pytest.Item) -> tuple[object, ...]:
    """What a test shares with others: the session's stack of its data path, else its
    module's fixtures."""
    callspec = getattr(item, "callspec", None)
    if "stack" in getattr(item, "fixturenames", ()) and callspec is not None:
        return ("stack", callspec.params.get("stack"))
    return ("module", item.path)


def disruptive_last(items: list[pytest.Item]) -> list[pytest.Item]:
    """Each disruptive test right after the last other test sharing its stack, in the order
    pytest chose (grouped by the session stack's data path): moved to the session's end, as
    before, every stack they share was started a second time there."""
    last = {_shared(item): i for i, item in enumerate(items)
            if item.get_closest_marker("disruptive") is None}

    def key(pair: tuple[int, pytest.Item]) -> tuple[int, int, int]:
        i, item = pair
        if item.get_closest_marker("disruptive") is None:
            return (i, 0, i)
        return (last.get(_shared(item), i), 1, i)

    return [item for _, item in sorted(enumerate(items), key=key)]
