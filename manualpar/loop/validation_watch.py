"""What the Trainer does with a validation pass's reduced values: best checkpoints and early
stopping (loop/best_checkpoints.py, loop/early_stopping.py), their checkpoint entries, and
finding the best checkpoint afterwards."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from manualpar.checkpoint.files import latest_checkpoint
from manualpar.errors import ConfigError, ConfigTypeError
from manualpar.loop.best_checkpoints import BestCheckpoints, read_best_index
from manualpar.loop.early_stopping import EarlyStopping

__all__ = ["ValidationWatch"]

log = logging.getLogger("manualpar.trainer")


class ValidationWatch:
    def __init__(
        self,
        early_stopping: EarlyStopping | None,
        best_checkpoints: BestCheckpoints | None,
        out_dir: Path,
        val_every: int | None,
    ) -> None:
        for name, value, kind in (
            ("early_stopping", early_stopping, EarlyStopping),
            ("best_checkpoints", best_checkpoints, BestCheckpoints),
        ):
            if value is not None and not isinstance(value, kind):
                raise ConfigTypeError(f"Trainer: {name} must be a {kind.__name__}, got {value!r}")
            if value is not None and not val_every:
                raise ConfigError(
                    f"Trainer({name}=...) watches validation values, which run every val_every "
                    "steps: pass val_every (and fit(val_data=...))"
                )
        self.early_stopping, self.best_checkpoints = early_stopping, best_checkpoints
        self.best_dir = out_dir / "best"
        if best_checkpoints is not None:
            best_checkpoints.directory = self.best_dir

    def entries(self) -> dict[str, Any]:
        """Checkpoint entries, reset (a run without a checkpoint starts them afresh)."""
        entries: dict[str, Any] = {}
        if self.early_stopping is not None:
            self.early_stopping.reset()
            entries["early_stopping"] = self.early_stopping
        if self.best_checkpoints is not None:
            self.best_checkpoints.reset()
            entries["best_checkpoints"] = self.best_checkpoints
        return entries

    def resumed(self, is_global_zero: bool) -> None:
        """After the resume: rank 0 removes best checkpoints the resumed state does not keep
        (saved by an interrupted run after its last rolling checkpoint)."""
        if self.best_checkpoints is not None and is_global_zero:
            self.best_checkpoints.prune()

    def stopped_before(self, step: int) -> bool:
        """A resumed run that early stopping had ended stays ended (a larger patience goes on)."""
        stopping = self.early_stopping
        if stopping is None or not stopping.should_stop:
            return False
        log.info(
            "early stopping had ended this run at step %d (%s: best %s at step %s, no "
            "improvement in %d validations); nothing to train. Raise patience to go on",
            step, stopping.monitor, stopping.best, stopping.best_step, stopping.wait,
        )  # fmt: skip
        return True

    def after_validation(
        self,
        values: Mapping[str, float],
        step: int,
        save: Callable[[Path], None],
        is_global_zero: bool,
    ) -> bool:
        """Save a best checkpoint (`save(path)`, collective) if this pass ranks, then ask early
        stopping; True to stop. `values` are the same on every rank, so are the decisions."""
        if not values:  # some rank had no batch: nothing was measured
            return False
        best = self.best_checkpoints
        path = best.consider(values, step) if best is not None else None
        if best is not None and path is not None:
            save(path)
            if is_global_zero:
                best.prune()
        stopping = self.early_stopping
        if stopping is None:
            return False
        stop = stopping.update(values, step)
        if is_global_zero:
            _warn_non_finite(stopping, values, step, stop)
        return stop

    def best(self) -> tuple[float, Path] | None:
        """(value, path) of the best checkpoint: this run's, else the one best.json lists."""
        if self.best_checkpoints is not None and self.best_checkpoints.kept:
            return self.best_checkpoints.best
        return read_best_index(self.best_dir)

    def checkpoint(self, caller: str, name: str | Path, checkpoint_dir: Path) -> Path:
        """The checkpoint `name` means: "latest" (rolling), "best", or a path."""
        if name in ("latest", "best"):
            best = self.best() if name == "best" else None
            path = latest_checkpoint(checkpoint_dir) if name == "latest" else best and best[1]
            if path is None:
                where = checkpoint_dir if name == "latest" else self.best_dir
                raise ConfigError(
                    f"Trainer.{caller}(checkpoint={name!r}): no checkpoint under {where}; "
                    "train first (fit), or pass a checkpoint path"
                )
            return Path(path)
        if not Path(name).is_dir():
            raise ConfigError(
                f"Trainer.{caller}(checkpoint={str(name)!r}): no such checkpoint directory; "
                "pass None, 'latest', 'best' or the path of a checkpoint"
            )
        return Path(name)


def _warn_non_finite(
    stopping: EarlyStopping, values: Mapping[str, float], step: int, stop: bool
) -> None:
    """Say when the monitored value is NaN or inf: a diverged model, never a plateau."""
    value = float(values[stopping.monitor])
    if math.isfinite(value):
        return
    if stop and stopping.non_finite is not None:
        log.warning(
            "early stopping: %s is %s at step %d (a diverged model?); every rank stops here "
            "(best %s at step %s). Pass EarlyStopping(check_finite=False) to count it as a "
            "validation without an improvement instead",
            stopping.monitor, value, step, stopping.best, stopping.best_step,
        )  # fmt: skip
    else:
        log.warning(
            "early stopping: %s is %s at step %d (a diverged model?); counted as a validation "
            "without an improvement (%d of patience %d: check_finite=False)",
            stopping.monitor, value, step, stopping.wait, stopping.patience,
        )  # fmt: skip
