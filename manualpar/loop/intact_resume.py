"""Resuming from the newest checkpoint that loads.

A latest checkpoint that cannot be read (cut short by a full disk or a half-finished copy,
changed after the save, its manifest unreadable) is skipped for the one before it, and the run
says so: a warning and a `checkpoint_skipped` event in metrics.jsonl for each one skipped. A
load checks every file before it copies anything (checkpoint/verify.py), so a skipped
checkpoint left the state as it was.

Every rank resumes from the same checkpoint: rank 0's listing is broadcast, a load fails on
every rank alike (checkpoint/agreement.py), and the ranks agree to fall back (one all-gather)
before any of them tries the next. A mismatch (a checkpoint of another model or configuration)
stops the run instead: an older checkpoint of the same run would not match either, and skipping
it would hide the change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manualpar.checkpoint.files import scan_checkpoints
from manualpar.errors import CheckpointError, CheckpointMismatchError
from manualpar.strategy import ManualParallelStrategy

__all__ = ["Resumed", "load_newest_intact"]

log = logging.getLogger("manualpar.trainer")


@dataclass
class Resumed:
    """The checkpoint loaded, and those skipped on the way to it (path, reason)."""

    path: Path
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def events(self, step: int) -> list[dict[str, Any]]:
        """One metrics.jsonl record per checkpoint skipped, at the step resumed from."""
        return [
            {
                "step": step,
                "event": "checkpoint_skipped",
                "checkpoint": str(path),
                "reason": reason,
                "resumed_from": str(self.path),
            }
            for path, reason in self.skipped
        ]


def load_newest_intact(
    strategy: ManualParallelStrategy,
    directory: Path,
    state: dict[str, Any],
    action: str = "resume",
    fix: str = "move them away to start afresh",
) -> Resumed | None:
    """Load the newest checkpoint of `directory` that loads into `state` (collective); None if
    there is none. Raises CheckpointError if there are some but none loads: "cannot `action`:
    ... Restore an intact copy, or `fix`". Trainer.validate and predict(checkpoint="latest")
    load the model's entries through it too, so they skip what fit's resume skips."""
    listing = scan_checkpoints(directory) if strategy.is_global_zero else ([], [])
    found, unreadable = strategy.broadcast(listing)  # every rank tries the same ones
    skipped = list(unreadable)
    for path, reason in unreadable:
        _warn(strategy, f"skipping checkpoint {path}: its manifest cannot be read ({reason})")
    for path, _manifest in found:
        try:
            strategy.load_checkpoint(path, state)
        except CheckpointError as error:
            if not _all_fall_back(strategy, error):
                raise
            skipped.append((path, str(error)))
            _warn(
                strategy,
                f"skipping checkpoint {path}: it cannot be loaded ({error}); trying the one "
                "before it",
            )
            continue
        return Resumed(path, skipped)
    if skipped:
        listed = "; ".join(f"{path.name}: {reason}" for path, reason in skipped)
        raise CheckpointError(
            f"cannot {action}: none of the checkpoints in {directory} can be read ({listed}). "
            f"Restore an intact copy, or {fix}"
        )
    return None


def _all_fall_back(strategy: ManualParallelStrategy, error: CheckpointError) -> bool:
    """True if every rank failed in a way an older checkpoint may not (a damaged file, not a
    mismatch). A rank that failed on a mismatch may see another rank's failure as a plain
    CheckpointError naming it, so the ranks decide together."""
    mine = not isinstance(error, CheckpointMismatchError)
    return all(strategy.all_gather_object(mine))


def _warn(strategy: ManualParallelStrategy, message: str) -> None:
    if strategy.is_global_zero:  # the same on every rank: said once
        log.warning("%s", message)
