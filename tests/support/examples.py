"""Triton's own example clients (tests/triton_examples), run unchanged as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "triton_examples"
# The sequence clients: their model is tests/sequence_models/simple_sequence.
SEQUENCE_EXAMPLES = ("simple_grpc_sequence_sync_infer_client.py",
                     "simple_grpc_sequence_stream_infer_client.py",
                     "simple_http_sequence_sync_infer_client.py")


def run_example(example: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLES / example), "-u", url, *args],
                          capture_output=True, text=True, timeout=120)


def sequence_example_passed(example: str, grpc_url: str, http_url: str) -> str | None:
    """None when the sequence client passed against these addresses, else what it said."""
    done = run_example(example, http_url if "_http_" in example else grpc_url)
    if done.returncode == 0 and "PASS: Sequence" in done.stdout:
        return None
    return f"{example}: rc {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
