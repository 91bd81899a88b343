"""The weights Trainer.validate and Trainer.predict run on: a checkpoint's model entry and extra
entries (sharded tables' state), never the optimizer.

`checkpoint="latest"` follows fit's resume rules (loop/intact_resume.py): a latest checkpoint
that cannot be read is skipped for the newest one that loads, with a warning naming it and why;
a mismatch (another model) stops; none that loads is a CheckpointError naming each. "best" and a
path load exactly that checkpoint: a damaged one raises, as nothing else stands in for it."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from manualpar.checkpoint.extra import extra_checkpoint_entries
from manualpar.loop.intact_resume import Resumed, load_newest_intact
from manualpar.loop.validation_watch import ValidationWatch
from manualpar.strategy import ManualParallelStrategy

__all__ = ["load_weights"]


def load_weights(
    strategy: ManualParallelStrategy,
    watch: ValidationWatch,
    caller: str,
    model: nn.Module,
    checkpoint: str | Path,
    checkpoint_dir: Path,
) -> Resumed:
    """Load `checkpoint` into the set-up `model` (collective): the path loaded and, for
    "latest", the checkpoints skipped on the way to it."""
    state = {"model": model, **extra_checkpoint_entries(model)}
    if checkpoint == "latest":
        action = f"load Trainer.{caller}(checkpoint='latest')"
        fix = "pass the path of a checkpoint that loads"
        loaded = load_newest_intact(strategy, checkpoint_dir, state, action, fix)
        if loaded is not None:
            return loaded
    path = watch.checkpoint(caller, checkpoint, checkpoint_dir)  # "latest" with none: raises
    strategy.load_checkpoint(path, state)
    return Resumed(path)
