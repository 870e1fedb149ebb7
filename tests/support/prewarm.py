"""The operator's pre-warm request as the tests make it: `make prewarm` on a stack's pre-warm
directory and its Serve config (docs/operations.md, "Pre-warming")."""

from __future__ import annotations

import subprocess
from datetime import datetime
from pathlib import Path


def request_prewarm(pods: int, until: datetime, directory: str | Path,
                    serve_config: str | Path) -> None:
    """At least `pods` GPU pods until `until`; a request replaces the one in force."""
    done = subprocess.run(["make", "-s", "prewarm", f"PODS={pods}", f"UNTIL={until.isoformat()}",
                           f"DIR={directory}", f"SERVE_CONFIG={serve_config}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
