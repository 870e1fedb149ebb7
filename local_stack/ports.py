"""Free ports on this machine, for the stack's own Ray processes and for stacks in tests.

Every port is drawn at random from between Ray's worker ports (10002-19999) and the kernel's
ephemeral ports (32768 on): a port the kernel handed out as free (bind to port 0) comes from
the ephemeral range, where any outgoing connection of Ray's may take it before our server binds
it (CI saw Serve's proxy fail to bind such a port)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterable
from pathlib import Path

LOW = 20000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Ports this process handed out: they are free until their server binds them, so a later draw
# must not hand them out again. Each with when it was drawn (time.monotonic()), or None for a
# port reserved for a running stack (until `release`).
_handed_out: dict[int, float | None] = {}
# A port drawn this long ago and free now is no one's any more (its server bound it and is
# gone, or never came: a stand-in of a test long over); it is drawn again only once no block
# is left otherwise. A session's scattered single ports left no 60-port block late in a
# `make test` (seen in a rehearsal: tests/unit/test_local_ports.py's draw refused).
STALE_S = 600.0
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        return min(int(_EPHEMERAL.read_text().split()[0]), 32768)
    except (OSError, ValueError, IndexError):
        return 32768


HIGH = _ephemeral_low()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _first_free_block(count: int) -> int | None:
    """A random start, then a walk up (wrapping once) to the first block of `count` ports
    none of which is handed out and each bindable; None when there is none."""
    end = HIGH - count  # the last block starts before this
    span = end - LOW
    if span <= 0:
        raise RuntimeError(f"no {count} consecutive ports fit between {LOW} and {HIGH}")
    first = _rng.randrange(LOW, end)
    walked = 0
    while walked < span:
        block = range(first, first + count)
        taken = next((port for port in block if port in _handed_out or not _bindable(port)), None)
        if taken is None:
            return first
        # No block holding `taken` fits: go on just past it.
        after = taken + 1 if taken + 1 < end else LOW
        walked += max(1, (after - first) % span)
        first = after
    return None


def free_port_range(count: int) -> int:
    """The first of `count` consecutive free ports, none handed out before (but for ports drawn
    over STALE_S ago, once no block is left otherwise).

    Starts at a random port, so that two processes rarely collide, and walks up (wrapping once),
    so that a long test session, whose handed-out ports are scattered, finds a gap while one
    exists (CI saw 500 random draws of a 60-port block miss every gap)."""
    first = _first_free_block(count)
    if first is None:
        now = time.monotonic()
        for port in [p for p, at in _handed_out.items() if at is not None and now - at > STALE_S]:
            del _handed_out[port]
        first = _first_free_block(count)
    if first is None:
        raise RuntimeError(f"no {count} consecutive free ports between {LOW} and {HIGH}")
    drawn = time.monotonic()
    _handed_out.update(dict.fromkeys(range(first, first + count), drawn))
    return first


def reserve(ports: Iterable[int]) -> None:
    """Ports someone else will bind later (a stack's Tritons): never handed out here."""
    _handed_out.update(dict.fromkeys(ports, None))


def release(ports: Iterable[int]) -> None:
    """Ports whose servers are gone (a stack stopped clean): they may be handed out again, so
    that a long test session's handed-out ports do not leave no gap for a block (CI saw no 60
    consecutive ports left late in a `make test` session)."""
    for port in ports:
        _handed_out.pop(port, None)


def free_ports(count: int) -> list[int]:
    return [free_port_range(1) for _ in range(count)]
