"""Which shared-memory regions the local stack frees when a container ends
(local_stack/processes.py orphaned_regions): only regions that existed before its pass over
every process's maps and that no pass found mapped. A region created while the pass ran belongs
to a Triton starting in another pod (it maps the region right after creating it); freeing it
broke that Triton's Python stubs in the middle of a KubeRay upgrade (tests/cluster/
test_upgrade.py: "Unable to initialize shared memory key ... No such file or directory", the new
cluster's Triton never ready). Here /dev/shm is a folder of the test's and the passes over the
processes' maps are stand-ins: the thing tested is the choice alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from local_stack import processes

OLD, NEW = (f"{processes.TRITON_REGION_PREFIX}{name}" for name in ("dead-pod", "starting-pod"))


def _with_passes(monkeypatch: pytest.MonkeyPatch, shm: Path,
                 passes: list[Callable[[], set[str]]]) -> None:
    monkeypatch.setattr(processes, "SHARED_MEMORY", shm)
    calls = iter(passes)
    monkeypatch.setattr(processes, "mapped_regions", lambda: next(calls)())


def test_a_region_created_during_the_pass_is_not_freed(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    (tmp_path / OLD).touch()

    def first_pass() -> set[str]:
        # A Triton in another pod creates its region while the pass reads other processes'
        # maps, and maps it after the pass read its own.
        (tmp_path / NEW).touch()
        return set()

    _with_passes(monkeypatch, tmp_path, [first_pass, lambda: set()])
    assert processes.orphaned_regions() == [OLD]


def test_a_region_mapped_only_by_the_second_pass_is_not_freed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / OLD).touch()
    (tmp_path / NEW).touch()
    # Created just before the pass, mapped by its Triton after the pass read that Triton.
    _with_passes(monkeypatch, tmp_path, [lambda: set(), lambda: {NEW}])
    assert processes.orphaned_regions() == [OLD]


def test_what_is_orphaned_is_freed_and_nothing_else(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    (tmp_path / OLD).touch()
    (tmp_path / NEW).touch()
    _with_passes(monkeypatch, tmp_path, [lambda: {NEW}, lambda: {NEW}])
    assert processes.free_orphaned_regions() == [OLD]
    assert sorted(p.name for p in tmp_path.iterdir()) == [NEW]
