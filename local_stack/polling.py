"""The one way the stacks, the harness and the tests wait: poll a check until it holds."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(what: str, check: Callable[[], object], timeout_s: float, every_s: float = 0.2,
          note: Callable[[str], None] | None = None, note_every_s: float = 10.0) -> None:
    """Polls `check` until it returns True; anything else it returns says why not, and the
    last such answer is in the TimeoutError. With `note`, says every `note_every_s` what it is
    still waiting for (a check may raise to stop the wait at once)."""
    deadline = time.monotonic() + timeout_s
    next_note = time.monotonic() + note_every_s
    while (detail := check()) is not True:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what} ({detail})")
        if note is not None and now > next_note:
            note(f"still waiting for {what}: {detail}")
            next_note = now + note_every_s
        time.sleep(every_s)
