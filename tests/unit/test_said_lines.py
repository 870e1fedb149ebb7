"""What the stacks say is read line by line (their ready lines, pod events): lines said from
many threads at once must never run into each other."""

from __future__ import annotations

import subprocess
import sys

import pytest

SAYERS = ["local_stack.stack", "local_stack.cluster.stack"]
SCRIPT = """
import threading
from {module} import SAID, say

def talk(n):
    for i in range(400):
        say(f"thread {{n}} line {{i}} " + "x" * 200)

threads = [threading.Thread(target=talk, args=(n,)) for n in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.mark.parametrize("module", SAYERS)
def test_lines_said_from_many_threads_stay_whole(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(module=module)],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.splitlines()
    broken = [line for line in lines if line.count("thread ") != 1 or not line.endswith("x")]
    assert len(lines) == 8 * 400 and broken == [], (len(lines), broken[:3])


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
