"""Fault injection for the tests: make this process die (SIGKILL) at a chosen point of a save.

Call `die_at(point)` inside a child of run_distributed on the rank that should die; the next
save_checkpoint then kills the process at that point. Points, in the order a save reaches them:

- "before_write":   tensors gathered, nothing written yet
- "after_write":    this rank's tensor shards written, before objects and the commit
- "before_commit":  rank 0 only: everything written, before the manifest and the rename
- "mid_overwrite":  rank 0 only: the old copy was moved aside, the new one not yet renamed in
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from checkpoint_models import make_model, train

import manualpar as mp

POINTS = ("before_write", "after_write", "before_commit", "mid_overwrite")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_at(point: str) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; choose one of {POINTS}")
    from torch.distributed.checkpoint import FileSystemWriter

    import manualpar.checkpoint.files as files
    import manualpar.checkpoint.save as checkpoint

    if point in ("before_write", "after_write"):
        original = FileSystemWriter.write_data

        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            if point == "before_write":
                _die()
            future = original(self, plan, planner)
            future.wait()
            _die()

        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    elif point == "before_commit":
        checkpoint.write_file_original = checkpoint.write_file  # type: ignore[attr-defined]

        def write_file(path: Any, data: bytes) -> None:
            if str(path).endswith(files.MANIFEST):
                _die()
            checkpoint.write_file_original(path, data)  # type: ignore[attr-defined]

        checkpoint.write_file = write_file  # type: ignore[assignment]
    else:
        original_replace = os.replace

        def replace(src: Any, dst: Any) -> None:  # this process dies right after: no cleanup
            original_replace(src, dst)
            if str(dst).endswith(".old"):
                _die()

        files.os.replace = replace  # type: ignore[assignment]


def save_twice(
    directory: str,
    victims: tuple[int, ...],
    point: str,
    overwrite: bool,
    asynchronous: bool = False,
) -> None:
    """Commit step 1 as ckpt_a, train a step, then save step 2 while `victims` die at `point`.

    `asynchronous`: the second save runs in the background (the points are then reached in
    its writer threads) while the main thread trains on, then waits for it."""
    strategy = mp.ManualParallelStrategy()
    model = make_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optimizer, steps=1)
    state = {"model": model, "optim": optimizer, "step": 1}
    strategy.save_checkpoint(Path(directory) / "ckpt_a", state)
    train(model, optimizer, steps=1)
    state["step"] = 2
    if strategy.rank in victims:
        die_at(point)
    target = Path(directory) / ("ckpt_a" if overwrite else "ckpt_b")
    if not asynchronous:
        strategy.save_checkpoint(target, state)
        return
    strategy.save_checkpoint_async(target, state)
    train(model, optimizer, steps=1)  # the next step runs while the files are written
    strategy.wait_for_checkpoint()


def reference_after_one_step() -> torch.nn.Module:
    """The parameters save_twice committed in ckpt_a."""
    model = make_model(seed=0)
    train(model, torch.optim.Adam(model.parameters(), lr=0.01), steps=1)
    return model


def assert_first_checkpoint_intact(directory: Path) -> None:
    """ckpt_a (step 1) loads on one process with exactly the parameters save_twice committed."""
    state = {"model": make_model(seed=9), "step": 0}
    mp.ManualParallelStrategy().load_checkpoint(directory / "ckpt_a", state, strict=False)
    assert state["step"] == 1
    for loaded, expected in zip(
        state["model"].parameters(), reference_after_one_step().parameters(), strict=True
    ):
        torch.testing.assert_close(loaded, expected, rtol=0, atol=0)
