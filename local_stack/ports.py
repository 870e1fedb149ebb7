"""Free ports on this machine, for the stack's own Ray processes and for stacks in tests."""

from __future__ import annotations

import random
import socket


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_range(count: int, low: int = 20000, high: int = 30000) -> int:
    """The first of `count` consecutive free ports between `low` and `high`, which lie
    between Ray's worker ports (10002-19999) and the kernel's ephemeral ports."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(low, high - count)
        sockets = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("0.0.0.0", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports between {low} and {high}")
