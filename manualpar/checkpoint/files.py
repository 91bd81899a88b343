"""Checkpoint files on disk: staging paths, atomic commit, the manifest, finding the latest.

A checkpoint is committed by renaming its staging copy (`.name.partial`) into place after every
rank finished writing; the manifest (`manualpar.json`) inside marks it complete.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from manualpar.errors import CheckpointError

__all__ = [
    "MANIFEST",
    "committed_checkpoints",
    "latest_checkpoint",
    "read_manifest",
    "scan_checkpoints",
]

log = logging.getLogger("manualpar.checkpoint")
MANIFEST = "manualpar.json"  # a sharded checkpoint folder without this file is incomplete
FORMAT = "manualpar-checkpoint"
FULL_KEY = "__manualpar__"  # the manifest inside a full export


def partial_path(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    try:
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise with_file(error, path) from None


def with_file(error: OSError, path: Path | str) -> OSError:
    """`error` naming `path` (a failed write or close says only "[Errno 28] ...")."""
    if error.filename is not None or error.errno is None:
        return error
    return OSError(error.errno, error.strerror, str(path))


_DISK_FULL = {
    errno.ENOSPC: ("no space left on device", "free disk space (delete old checkpoints)"),
    errno.EDQUOT: ("disk quota exceeded", "free space in your quota"),
    errno.EFBIG: (
        "file too large",
        "raise the file-size limit (ulimit -f) or use a filesystem that allows larger files",
    ),
}


def describe_failure(error: BaseException) -> str:
    """One line for an error report: a full disk says so and names the file."""
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
        cause, fix = _DISK_FULL[error.errno]
        where = f"could not write {error.filename}" if error.filename else "a write failed"
        return (
            f"{cause}: {where} ([Errno {error.errno}] {error.strerror}); {fix}, or save elsewhere"
        )
    # some errors carry no message (a read past the end of a file): their type says what it was
    return str(error) or f"{type(error).__name__} (no message)"


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def prepare(path: Path, staging: Path, overwrite: bool, make_dir: bool, needed: int = 0) -> None:
    """Check the target before anything is written: overwrite, a writable parent, free space."""
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True or choose another path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(
            f"cannot create checkpoint directory {path.parent}: {error}; save under a directory "
            "you can write to (no part of the path may be an existing file)"
        ) from None
    if not os.access(path.parent, os.W_OK):
        raise CheckpointError(
            f"checkpoint directory {path.parent} is not writable; fix its "
            "permissions or save elsewhere"
        )
    check_free_space(path.parent, needed, path)
    remove(staging)  # left by an earlier crash; never committed, safe to drop
    if make_dir:
        (staging / "objects").mkdir(parents=True)


def check_free_space(directory: Path, needed: int, path: Path) -> None:
    """Refuse a save the filesystem cannot hold, before writing a byte: a disk that fills up
    mid-save fails later, with a partial copy taking the space (the previous checkpoint is safe
    either way). `needed` is an estimate (the tensors' bytes); 0 skips the check."""
    if needed <= 0:
        return
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointError(
            f"not enough disk space to save {path}: it needs about {_size(needed)} but "
            f"{directory} has {_size(free)} free; delete old checkpoints or save elsewhere"
        )


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB ({count} bytes)"


def _old_path(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def swap_in(staging: Path, path: Path) -> None:
    """Swap the finished staging copy in; an existing checkpoint is replaced only after.

    Overwriting takes two renames (old copy aside, new copy in). A crash between them leaves the
    previous checkpoint as `.name.old`: `resolve` and `latest_checkpoint` still find it, and the
    next save puts it back before it swaps again.
    """
    old = _old_path(path)
    if old.exists() and not path.exists():
        os.replace(old, path)  # finish an interrupted swap: the previous copy comes back first
    remove(old)
    if path.exists():
        os.replace(path, old)
    os.replace(staging, path)
    _fsync_dir(path.parent)
    remove(old)


def resolve(path: Path) -> Path:
    """`path`, or its previous copy if a crash interrupted an overwrite of it."""
    old = _old_path(path)
    if not path.exists() and (old / MANIFEST).is_file():
        log.warning(
            "%s is missing but its previous copy %s is complete (an overwrite was "
            "interrupted); using the previous copy",
            path,
            old,
        )
        return old
    return path


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a committed sharded checkpoint (raises CheckpointError otherwise)."""
    path = Path(path)
    if path.name.endswith(".partial"):
        raise CheckpointError(f"{path} is a partial checkpoint that was never committed")
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a sharded checkpoint directory")
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        hint = (
            ("it holds torch.distributed.checkpoint files but no manifest: the save did not finish")
            if (path / ".metadata").exists()
            else "it is not a checkpoint directory"
        )
        raise CheckpointError(f"{path} is not a complete manualpar checkpoint: {hint}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest_path} is unreadable or corrupted: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a manualpar manifest")
    return manifest


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The committed sharded checkpoint in `directory` with the highest step (then newest).

    Partial saves (`.name.partial`) and unreadable entries are skipped; None if there is none.
    """
    found = committed_checkpoints(directory)
    return found[0] if found else None


def committed_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The committed sharded checkpoints in `directory`, newest first (highest step, then the
    latest commit). Partial saves are skipped, and so are entries whose manifest cannot be
    read (a warning names each)."""
    found, unreadable = scan_checkpoints(directory)
    for entry, reason in unreadable:
        log.warning("skipping %s: %s", entry, reason)
    return [entry for entry, _ in found]


def scan_checkpoints(
    directory: str | os.PathLike,
) -> tuple[list[tuple[Path, dict[str, Any]]], list[tuple[Path, str]]]:
    """The committed checkpoints in `directory` with their manifests, newest first, and the
    entries that look committed but whose manifest cannot be read, with the reason."""
    directory = Path(directory)
    if not directory.exists():
        return [], []
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory of checkpoints")
    found: dict[Path, dict[str, Any]] = {}
    unreadable: list[tuple[Path, str]] = []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):  # staging copies are never candidates, but the
            if not entry.name.endswith(".old"):  # previous copy of an interrupted overwrite is
                continue
            entry = resolve(directory / entry.name[1 : -len(".old")])
        if entry in found or not (entry / MANIFEST).is_file():
            continue
        try:
            found[entry] = read_manifest(entry)
        except CheckpointError as error:
            unreadable.append((entry, str(error)))
    newest = sorted(found, key=lambda entry: _recency(found[entry]), reverse=True)
    return [(entry, found[entry]) for entry in newest], unreadable


def _recency(manifest: dict[str, Any]) -> tuple[int, float]:
    """(step, commit time) of a manifest; -1 and 0.0 for what is missing or not a number."""
    step, committed = manifest.get("step"), manifest.get("committed_at")
    return (
        step if isinstance(step, int) and not isinstance(step, bool) else -1,
        float(committed) if isinstance(committed, (int, float)) else 0.0,
    )


def read_full(path: Path) -> dict[str, Any]:
    """A full export, loaded with weights_only=True (memory-mapped: tensors load lazily)."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise CheckpointError(
            f"{path} is corrupted, truncated or not a checkpoint: {error}"
        ) from None
    if not isinstance(blob, dict) or FULL_KEY not in blob:
        raise CheckpointError(f"{path} is not a manualpar full checkpoint (no {FULL_KEY!r})")
    return blob
