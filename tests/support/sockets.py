"""Which process listens on a TCP port of this machine, read from /proc as `ss -ltnp` does."""

from __future__ import annotations

import os
from pathlib import Path

LISTEN = "0A"  # the TCP state of a listening socket in /proc/net/tcp


def listening_pid(port: int) -> int:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == LISTEN:
                inodes.add(fields[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in {f"socket:[{inode}]" for inode in inodes}:
                    return int(proc.name)
        except OSError:
            continue
    raise LookupError(f"no process listens on port {port}")
