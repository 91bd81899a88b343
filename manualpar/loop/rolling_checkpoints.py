"""The Trainer's rolling checkpoints, `<out_dir>/checkpoints/step_<n>/`: saved every N steps and
at the end (synchronously or in the background), the `keep_last` newest kept, a run resumed
from the latest committed one."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from manualpar.checkpoint.files import scan_checkpoints
from manualpar.loop.intact_resume import Resumed, load_newest_intact
from manualpar.loop.resume_lr import learning_rates, report_restored_lrs
from manualpar.strategy import ManualParallelStrategy

__all__ = ["RollingCheckpoints"]

log = logging.getLogger("manualpar.trainer")


class RollingCheckpoints:
    def __init__(
        self,
        strategy: ManualParallelStrategy,
        directory: Path,
        keep_last: int,
        asynchronous: bool,
    ) -> None:
        self.strategy, self.directory = strategy, directory
        self.keep_last, self.asynchronous = keep_last, asynchronous
        self.saved_at: int | None = None  # the step of the checkpoint last saved or resumed

    def resume(self, state: dict[str, Any], resume_lr: str) -> Resumed | None:
        """Load the newest committed checkpoint that loads into `state` (collective; those
        that cannot be read are skipped, loop/intact_resume.py); None if there is none."""
        configured = learning_rates(state)
        resumed = load_newest_intact(self.strategy, self.directory, state)
        if resumed is None:
            return None
        self.saved_at = state["step"]
        log.info(
            "resumed from %s at step %d: restored %s",
            resumed.path,
            state["step"],
            ", ".join(sorted(state)),
        )
        report_restored_lrs(configured, state, keep=resume_lr)
        return resumed

    def save(self, state: dict[str, Any], step: int) -> None:
        path = self.directory / f"step_{step:08d}"
        if self.asynchronous:
            self.strategy.wait_for_checkpoint()  # the previous one commits first
            self.prune()
            self.strategy.save_checkpoint_async(path, state)
        else:
            self.strategy.save_checkpoint(path, state)
            self.prune()
        self.saved_at = step

    def prune(self) -> None:
        """Keep the `keep_last` newest committed checkpoints (rank 0 deletes the others).

        One whose manifest cannot be read, or records no step, is kept and named in a warning:
        which run or step it holds is unknown, and it never stops the run."""
        if not self.strategy.is_global_zero or not self.directory.is_dir():
            return
        found, unreadable = scan_checkpoints(self.directory)
        for path, reason in unreadable:
            log.warning("keeping %s, which prune cannot date: %s", path, reason)
        stepped = []
        for path, manifest in found:
            if path.name.startswith("."):  # an interrupted overwrite's previous copy
                continue
            if isinstance(manifest.get("step"), int) and not isinstance(manifest["step"], bool):
                stepped.append(path)
            else:
                log.warning(
                    "keeping %s, which prune cannot date: its manifest records no step (%r)",
                    path,
                    manifest.get("step"),
                )
        for old in stepped[self.keep_last :]:  # newest first
            shutil.rmtree(old, ignore_errors=True)

    def abandon_pending(self) -> None:
        """fit() failed: let a background save finish or fail (bounded by the collective
        timeout), never replacing the error that stopped fit. A save that cannot finish is
        never committed, so the previous checkpoint stays the latest."""
        try:
            self.strategy.wait_for_checkpoint()
        except Exception as error:
            log.warning(
                "the checkpoint being written when fit() failed was not committed (%s); "
                "the previous one is still the latest",
                error,
            )
