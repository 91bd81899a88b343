"""Randomized kills during a save: the previous checkpoint always survives and stays loadable.

Each trial saves a committed checkpoint (step 1), trains one more step, then saves step 2 (a new
directory or an overwrite of the first) while one rank or both are SIGKILLed at a random point.
The background-save test kills a rank at each point of a save written while training goes on.
CI runs a few seeded trials; a soak run uses more:

    MANUALPAR_FAULT_TRIALS=200 MANUALPAR_FAULT_SEED=$RANDOM pytest tests/e2e/test_save_faults.py
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from faults import POINTS, assert_first_checkpoint_intact, save_twice

import manualpar as mp
from manualpar.testing import run_distributed

TRIALS = int(os.environ.get("MANUALPAR_FAULT_TRIALS", "6"))
SEED = int(os.environ.get("MANUALPAR_FAULT_SEED", "0"))


def _trial_plan(index: int) -> tuple[tuple[int, ...], str, bool]:
    rng = random.Random(SEED * 1000 + index)
    point = rng.choice(["before_write", "after_write", "before_commit", "mid_overwrite"])
    # Only rank 0 commits, so only rank 0 can die at the commit points.
    victims = (
        (0,) if point in ("before_commit", "mid_overwrite") else rng.choice([(0,), (1,), (0, 1)])
    )
    overwrite = point == "mid_overwrite" or rng.random() < 0.5
    return victims, point, overwrite


@pytest.mark.parametrize("index", range(TRIALS))
def test_kill_during_save_keeps_the_previous_checkpoint(index: int, tmp_path: Path) -> None:
    victims, point, overwrite = _trial_plan(index)
    _check_trial(tmp_path, victims, point, overwrite, asynchronous=False)


@pytest.mark.parametrize("point", POINTS)
def test_kill_during_background_save_keeps_the_previous_checkpoint(
    point: str, tmp_path: Path
) -> None:
    """The same kills while the save is written in the background and the next step trains."""
    victims = (0,) if point in ("before_commit", "mid_overwrite") else (1,)
    _check_trial(tmp_path, victims, point, point == "mid_overwrite", asynchronous=True)


def _check_trial(
    tmp_path: Path, victims: tuple[int, ...], point: str, overwrite: bool, *, asynchronous: bool
) -> None:
    outcomes = run_distributed(
        save_twice,
        world_size=2,
        args=(str(tmp_path), victims, point, overwrite, asynchronous),
        collective_timeout=15,
        timeout=60,
        allow_failure=True,
    )
    for outcome in outcomes:
        if outcome.rank in victims:
            assert outcome.exitcode == -9, outcome.describe()
        else:  # the survivor failed with an error naming the save, it did not hang
            assert outcome.error_type in {"CollectiveError", "CheckpointError"}, outcome.describe()
            assert outcome.error.startswith(("save_checkpoint(", "preparing checkpoint")), (
                outcome.describe()
            )
    latest = mp.latest_checkpoint(tmp_path)
    assert latest is not None and mp.read_manifest(latest)["step"] == 1, (latest, point)
    assert_first_checkpoint_intact(tmp_path)
    assert not (tmp_path / "ckpt_b").exists()
    # The next save to the same place recovers and commits normally.
    mp.ManualParallelStrategy().save_checkpoint(tmp_path / "ckpt_a", {"step": 3})
    assert mp.read_manifest(mp.latest_checkpoint(tmp_path))["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".partial")) == [
        "ckpt_a"
    ]
