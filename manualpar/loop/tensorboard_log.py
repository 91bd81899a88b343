"""The metrics.jsonl records as TensorBoard scalars, in `<out_dir>/tensorboard/` (rank 0).

tensorboard is an optional extra (`pip install manualpar[tensorboard]`): nothing imports it
unless a Trainer asks for this log. A resumed run appends a new event file that starts with a
purge marker at the step after its checkpoint: TensorBoard's readers then drop what the
interrupted run wrote after that step, as the metrics file drops those lines.

The directory is checked when the Trainer is made, on every rank (each also writes checkpoints
under the same out_dir), so a file in its place or a read-only directory stops every rank
before training, not rank 0 alone at its first record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from manualpar.errors import MissingDependencyError, OutputPathError

__all__ = ["TensorBoardLog", "check_log_directory", "require_tensorboard"]


def require_tensorboard() -> None:
    """Fail early, on every rank, when tensorboard is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError(
            "Trainer(tensorboard=True) needs the tensorboard package, which is not installed: "
            "pip install 'manualpar[tensorboard]' (or pass tensorboard=False)"
        ) from error


def check_log_directory(directory: Path) -> None:
    """OutputPathError unless `directory` is, or can be made as, a writable directory."""
    existing = directory
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent  # the nearest part of the path that exists
    if not existing.is_dir():
        which = "it" if existing == directory else str(existing)
        raise _unwritable(directory, f"{which} is a file, not a directory", "Move it away")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _unwritable(directory, f"{existing} is not writable", "Fix its permissions")


def _unwritable(directory: Path, problem: str, fix: str) -> OutputPathError:
    return OutputPathError(
        f"Trainer(tensorboard=True): cannot write the TensorBoard log to {directory}: "
        f"{problem}. {fix}, pass another out_dir, or pass tensorboard=False"
    )


class TensorBoardLog:
    """Writes each metrics record it is given: numbers as scalars at the record's step (their
    metrics.jsonl names are the tags), event records as text under "events"."""

    def __init__(self, directory: Path) -> None:
        require_tensorboard()
        check_log_directory(directory)
        self.directory = directory
        self._writer: Any = None
        self._purge_step: int | None = None

    def start(self, purge_step: int | None) -> None:
        """Begin a new event file at the next write; with `purge_step`, readers drop earlier
        files' events at that step and after."""
        self.close()
        self._purge_step = purge_step

    def write(self, record: Mapping[str, Any]) -> None:
        try:
            self._write(record)
        except OSError as error:  # the directory changed since the check: name it
            check_log_directory(self.directory)
            raise _unwritable(self.directory, str(error), "Check the directory") from error

    def _write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.directory), purge_step=self._purge_step)
            self._purge_step = None
        if "event" in record:
            self._writer.add_text("events", json.dumps(dict(record)), step)
        else:
            for name, value in record.items():
                if (
                    name != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self._writer.add_scalar(name, value, step)
        self._writer.flush()  # a crash loses nothing metrics.jsonl kept

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
