"""What Linux's /proc says about this machine's processes and sockets, for tests that stop a
job's whole process tree or check which process listens on a port (tests/support/launch.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["descendants", "listeners", "process_group", "sockets"]


def listeners(port: int) -> set[str]:
    """The inodes of the sockets listening on TCP `port` (Linux /proc, IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()  # local address (hex ip:port), state (0A: LISTEN), inode
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    found.add(fields[9])
    return found


def sockets(pids: Sequence[int]) -> set[str]:
    """The inodes of the sockets the processes `pids` hold open."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        found.add(link[len("socket:[") : -1])
    return found


def descendants(root: int) -> list[int]:
    """Every process below `root` (Linux /proc), children before grandchildren."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        children = parents.get(todo.pop(0), [])
        found += children
        todo += children
    return found


def process_group(pid: int) -> int | None:
    """The process group of `pid`, None once it is gone."""
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
