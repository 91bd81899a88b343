"""One owner per row file: a disk tier locks each of its files for its whole life.

Two tiers on one directory (a second job, a leftover process, or two collections of one job
whose tables share a name) would write the same file: the second used to truncate it and the
first went on training on zeroed rows, with no error. Each row file is now locked with `flock`
(exclusive, held until the file is closed or the process exits, even if it is killed) *before*
anything is truncated, and a `<file>.owner.json` beside it says what the file holds and who
holds it, so a second opener is refused with the holder named and the file left untouched.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from manualpar.errors import BuilderError

__all__ = ["claim_file", "owner_path"]


def owner_path(path: Path) -> Path:
    return path.with_name(path.name + ".owner.json")


def claim_file(fd: int, path: Path, what: str, holds: dict[str, Any]) -> None:
    """Lock the open file `fd` at `path` for this process, or raise BuilderError naming the
    process that holds it; then record `holds` (what the file holds) and this owner beside it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise BuilderError(
            f"disk tier: the {what} file {str(path)!r} is in use by another disk tier "
            f"({_describe_holder(path)}); two tiers writing one file would overwrite each "
            "other's rows. Give each job (and each collection whose tables share a name) its "
            "own DiskTier(directory=...), or stop the other process first"
        ) from None
    owner = {
        **holds,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "opened": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    record = owner_path(path)
    partial = record.with_name(record.name + ".partial")
    partial.write_text(json.dumps(owner, indent=1) + "\n")
    partial.replace(record)


def _describe_holder(path: Path) -> str:
    """`process 123 on host-a, table 'ads' rows 0..1000, since ...`, from the owner record."""
    with contextlib.suppress(OSError, ValueError):
        owner = json.loads(owner_path(path).read_text())
        same = " (this process)" if owner.get("pid") == os.getpid() else ""
        return (
            f"process {owner.get('pid')}{same} on {owner.get('host')}, holding "
            f"{owner.get('holds', 'rows')}, since {owner.get('opened')}"
        )
    return f"a process that left no readable {owner_path(path).name}"
