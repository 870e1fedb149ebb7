"""The marker set by folder: tests/stack/ and tests/cluster/ start real stacks (make unit leaves
them out); the marker `processes` on a test that starts any process (Envoy, Triton, kubectl,
promtool, a shell): make unit leaves those out too, and under it (SONIC_RAY_UNIT=1) a test
that starts a process unmarked fails, naming the program; disruptive tests (they kill part of
a shared stack) run after the others that share it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
# Folders whose tests start stacks (make local's, or make cluster's).
STACK_FOLDERS = (HERE / "stack", HERE / "cluster")
# Set by make unit: the tier that starts no process and needs no root.
UNIT_ENV = "SONIC_RAY_UNIT"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "disruptive: kills part of the shared stack; runs after the other tests"
    )
    config.addinivalue_line("markers", "stack: needs a running stack (the tests in tests/stack/)")
    config.addinivalue_line(
        "markers", "processes: starts a process (Envoy, Triton, kubectl, promtool...): not in "
        "make unit")
    if os.environ.get(UNIT_ENV) == "1":
        _refuse_processes()


# The test running now (its fixtures' set-up and tear-down included), for the unit tier's guard.
_running: list[pytest.Item] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    _running.append(item)
    yield
    _running.pop()


def _refuse_processes() -> None:
    """Under make unit, a test that starts a process (in it or in any fixture it uses) without
    the `processes` marker fails, naming what it started."""
    start = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> Any:
        item = _running[-1] if _running else None
        if item is not None and not item.get_closest_marker("processes"):
            program = str(args if isinstance(args, str | bytes) else next(iter(args)))
            raise RuntimeError(f"{item.nodeid} starts a process ({program!s}): mark it "
                               "`processes` (make unit starts none)")
        return start(self, args, *rest, **kwargs)

    subprocess.Popen._execute_child = guarded  # type: ignore[attr-defined]


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
