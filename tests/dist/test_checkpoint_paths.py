"""Ranks that pass different checkpoint paths (a per-rank name, a timestamp) are refused on
every rank before anything is written or loaded, naming each rank's path."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_models import make_model

import manualpar as mp
from manualpar.testing import run_distributed

pytestmark = pytest.mark.timeout(120)


def _per_rank_paths(directory: str, how: str) -> dict:
    """Save (or load) with a per-rank path; report the error and that the group still works."""
    strategy = mp.ManualParallelStrategy()
    state = {"model": make_model(seed=0), "step": 1}
    root = Path(directory)
    error = None
    try:
        if how == "load":
            strategy.save_checkpoint(root / "ckpt", state)
            strategy.load_checkpoint(root / ("ckpt" if strategy.rank == 0 else "ckpt_1"), state)
        elif how == "async":
            strategy.save_checkpoint_async(root / f"ckpt_{strategy.rank}", state).wait()
        else:
            strategy.save_checkpoint(root / f"ckpt_{strategy.rank}", state, full=how == "full")
    except mp.ManualParError as caught:
        error = (type(caught).__name__, str(caught))
    total = strategy.all_reduce(1.0, op="sum").item()  # the group is still in step
    strategy.teardown()
    return {"error": error, "total": total}


@pytest.mark.parametrize("how", ["sharded", "full", "async", "load"])
def test_ranks_passing_different_paths_are_refused_on_every_rank(how: str, tmp_path: Path) -> None:
    results = run_distributed(_per_rank_paths, world_size=2, args=(str(tmp_path), how))
    operation = {"async": "save_checkpoint_async", "load": "load_checkpoint"}.get(
        how, "save_checkpoint"
    )
    name = "ckpt" if how == "load" else "ckpt_0"
    expected = (
        f"{operation}: the ranks passed different paths (rank 0: {tmp_path / name}, rank 1: "
        f"{tmp_path / 'ckpt_1'}); every rank must pass the same path (build it from the step, "
        "not from the rank or the clock, or broadcast rank 0's); nothing was written or loaded"
    )
    for result in results:
        assert result == {"error": ("CheckpointError", expected), "total": 2.0}
    # Nothing was written: no checkpoint and no partial copy (the load case's own save aside).
    assert sorted(p.name for p in tmp_path.iterdir()) == (["ckpt"] if how == "load" else [])
    assert mp.latest_checkpoint(tmp_path) == (tmp_path / "ckpt" if how == "load" else None)
