"""Early stopping and best checkpoints on 2 real ranks: the monitored value is the mean over
ranks (each rank alone would decide otherwise), every rank stops at the same step, a resumed
run continues the patience count, and the kept best checkpoints are the best and load."""

from __future__ import annotations

from pathlib import Path

from trainer_watch_cases import STOP_STEP, early_stopping_run, records

import manualpar as mp
from manualpar.testing import run_distributed


def test_every_rank_stops_at_the_same_step_and_keeps_the_best_checkpoints(tmp_path: Path) -> None:
    results = run_distributed(early_stopping_run, 2, args=(str(tmp_path),), timeout=60)
    for result in results:
        assert result["step"] == STOP_STEP and result["stopped_early"]
        assert result["wait"] == 3
        assert result["latest"] == STOP_STEP  # the final checkpoint, as fit saves at the end
        # keep=2: 0.6 at step 8, then 0.59 at step 14 (0.58 at 12 was kept, then dropped)
        assert result["best_checkpoint"] == "step_00000008" and result["best_score"] == 0.6
        assert result["loaded"] == {
            "step_00000008": {"passes": 4, "same_as_rolling": True},
            "step_00000014": {"passes": 7, "same_as_rolling": True},
        }
    lines = records(tmp_path)
    assert lines[-1] == {
        "step": STOP_STEP, "event": "early_stopping", "monitor": "val/score", "best": 0.6,
        "best_step": 8, "patience": 3,
    }  # fmt: skip
    assert [r["step"] for r in lines if "val/score" in r] == [2, 4, 6, 8, 10, 12, 14]
    assert [r["step"] for r in lines if "loss" in r][-1] == STOP_STEP  # the last window
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == [
        "best.json", "step_00000008", "step_00000014",
    ]  # fmt: skip


def test_a_resumed_run_continues_the_patience_count(tmp_path: Path) -> None:
    """Crash in step 13, after the checkpoint of step 12 (two validations without improvement
    so far): the rerun stops at step 14 as the uninterrupted run did. A patience count that
    started afresh would run to step 18 (best would restart at 0.59)."""
    crashed = run_distributed(
        early_stopping_run, 2, args=(str(tmp_path), 12), timeout=60, allow_failure=True
    )
    assert any(o.error and "injected crash at step 12" in o.error for o in crashed)
    assert mp.read_manifest(mp.latest_checkpoint(tmp_path / "checkpoints"))["step"] == 12
    resumed = run_distributed(early_stopping_run, 2, args=(str(tmp_path),), timeout=60)
    for result in resumed:
        assert result["step"] == STOP_STEP and result["stopped_early"] and result["wait"] == 3
        assert result["best_checkpoint"] == "step_00000008" and result["best_score"] == 0.6
        assert set(result["loaded"]) == {"step_00000008", "step_00000014"}
    steps = [r["step"] for r in records(tmp_path) if "val/score" in r]
    assert steps == [2, 4, 6, 8, 10, 12, 14]  # nothing recorded twice
