"""One owner per row file: a disk tier locks each of its files for its whole life.

Two tiers on one directory (a second job, a leftover process, or two collections of one job
whose tables share a name) would write the same file: the second used to truncate it and the
first went on training on zeroed rows, with no error. Each row file is now locked with `flock`
(exclusive, held until the file is closed or the process exits, even if it is killed) *before*
anything is truncated, and a `<file>.owner.json` beside it says what the file holds and who
holds it, so a second opener is refused with the holder named and the file left untouched.
The record is written private to the user, through a scratch name never followed as a link.
The lock is the open file's: a process forked from the holder inherits it, so the tier lets go
of its files in forked children (row_file.py), and a lock that outlives its named holder is
described as such, with the processes that hold the file open.
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

from manualpar.errors import BuilderError, StorageError

__all__ = ["claim_file", "owner_path"]


def owner_path(path: Path) -> Path:
    return path.with_name(path.name + ".owner.json")


def claim_file(fd: int, path: Path, what: str, holds: dict[str, Any]) -> None:
    """Lock the open file `fd` at `path` for this process, or raise BuilderError naming the
    process that holds it; then record `holds` (what the file holds) and this owner beside it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise BuilderError(_refusal(fd, path, what)) from None
    owner = {
        **holds,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "opened": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    _write_record(owner_path(path), json.dumps(owner, indent=1) + "\n", what)


def _write_record(record: Path, text: str, what: str) -> None:
    """`text` to `record` through a fresh scratch file (created, never followed as a link: a
    link there would have its target overwritten), then renamed into place."""
    partial = record.with_name(record.name + ".partial")
    try:
        partial.unlink(missing_ok=True)  # left by a crash, or a link: removed, not followed
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        partial.replace(record)
    except OSError as error:
        failed = error.filename2 or error.filename or record
        raise StorageError(
            f"disk tier: cannot write the owner record {str(failed)!r} of the {what} file: "
            f"{error.strerror}; remove it (the tier writes there what the file holds and who "
            "holds it), or give DiskTier(directory=...) a directory of its own"
        ) from None


def _refusal(fd: int, path: Path, what: str) -> str:
    """Why the file at `path` (open here as `fd`) is locked, and what to do."""
    owner = _read_owner(path)
    pid = owner.get("pid") if owner is not None else None
    if owner is not None and isinstance(pid, int) and _exited(pid, owner.get("host")):
        holders = ", ".join(map(str, _processes_holding(path, fd))) or "none found"
        return (
            f"disk tier: the {what} file {str(path)!r} is in use: process {pid}, named in its "
            "owner record, has exited, but the file is still locked: a process it started "
            f"inherited the file (open in process {holders}). Stop that process (it may "
            "still write the file), or give this job its own DiskTier(directory=...)"
        )
    return (
        f"disk tier: the {what} file {str(path)!r} is in use by another disk tier "
        f"({_describe_holder(path, owner)}); two tiers writing one file would overwrite each "
        "other's rows. Give each job (and each collection whose tables share a name) its "
        "own DiskTier(directory=...), or stop the other process first"
    )


def _read_owner(path: Path) -> dict[str, Any] | None:
    """The owner record beside `path`, or None if there is no readable one."""
    with contextlib.suppress(OSError, ValueError):
        owner = json.loads(owner_path(path).read_text())
        if isinstance(owner, dict):
            return owner
    return None


def _describe_holder(path: Path, owner: dict[str, Any] | None) -> str:
    """`process 123 on host-a, table 'ads' rows 0..1000, since ...`, from the owner record."""
    if owner is None:
        return f"a process that left no readable {owner_path(path).name}"
    same = " (this process)" if owner.get("pid") == os.getpid() else ""
    return (
        f"process {owner.get('pid')}{same} on {owner.get('host')}, holding "
        f"{owner.get('holds', 'rows')}, since {owner.get('opened')}"
    )


def _exited(pid: int, host: object) -> bool:
    """Whether process `pid` of this host has exited (a zombie has); False if on another."""
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: alive
        return False
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return False


def _processes_holding(path: Path, own_fd: int) -> list[int]:
    """The processes with `path` open (where /proc lists them), but for this process's `own_fd`:
    the lock's holders, as far as this user may see."""
    target = os.path.realpath(path)
    found = []
    for fds in Path("/proc").glob("[0-9]*/fd"):
        pid = int(fds.parent.name)
        with contextlib.suppress(OSError):
            for fd in fds.iterdir():
                if (pid, int(fd.name)) != (os.getpid(), own_fd) and os.readlink(fd) == target:
                    found.append(pid)
                    break
    return sorted(found)
