"""A lone Triton (local_stack/triton.py, `lone`: the benches' comparison Triton): one that
exits before it is ready is an error at once, with its log, not a wait until the timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from local_stack import triton

# Triton's own words for a model repository that is not there, from its log.
EXITED = r"(?s)Triton exited \(1\): .*failed to stat file .*no-such-repository"


def test_a_lone_triton_that_exits_is_an_error_at_once_with_its_log(tmp_path: Path) -> None:
    # Without the check this is a TimeoutError after lone's 120 s wait.
    with pytest.raises(RuntimeError, match=EXITED), \
            triton.lone(tmp_path / "no-such-repository",
                        triton.prepare_backends(tmp_path / "backends"), tmp_path / "triton.log",
                        lambda url: f"{url} not ready"):
        pytest.fail("lone yielded a Triton that had exited")


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
