"""make unit's tier (tests/conftest.py): under SONIC_RAY_UNIT=1 a test that starts a process,
itself or in a fixture, fails naming the program unless it is marked `processes`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = '''
import subprocess

import pytest


@pytest.fixture(scope="module")
def started() -> None:
    subprocess.run(["true"], check=True)


def test_starts_one() -> None:
    subprocess.run(["true"], check=True)


def test_its_fixture_starts_one(started: None) -> None:
    pass


@pytest.mark.processes
def test_marked() -> None:
    subprocess.run(["true"], check=True)


def test_starts_none() -> None:
    pass
'''


def test_the_unit_tier_refuses_unmarked_processes(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(CASES)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-q", "-rfE", str(tmp_path / "test_cases.py")],
        cwd=ROOT, env={**os.environ, "SONIC_RAY_UNIT": "1"}, capture_output=True, text=True,
        timeout=120, check=False)
    out = done.stdout
    assert "2 failed, 2 passed" in out or "1 failed, 2 passed, 1 error" in out, out
    assert "test_starts_one starts a process (true)" in out, out
    assert "test_its_fixture_starts_one starts a process (true)" in out, out


pytestmark = pytest.mark.processes
