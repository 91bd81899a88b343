"""Metric objects in validation on 2 real ranks with uneven batches: the recorded value is the
exact value over every rank's samples (not a mean of rank means), the object is reset before
each pass, plain numbers keep their mean; validate() of the best checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_watch_cases import metric_objects_run

from manualpar.testing import run_distributed


def test_metric_objects_are_exact_over_uneven_ranks_and_reset_each_pass(tmp_path: Path) -> None:
    results = run_distributed(metric_objects_run, 2, args=(str(tmp_path),), timeout=60)
    for result in results:
        # 2 batches of 3 rows on rank 0, of 5 on rank 1: 16 samples per pass
        assert result["samples"] == 16
        assert result["exact"] != pytest.approx(result["mean_of_means"], rel=1e-3)
        for values in (result["last"], result["validated"]):
            assert values["val/abs_y"] == pytest.approx(result["exact"], rel=1e-6)
            assert values["val/samples"] == 16  # reset before each pass: not 32, 48
            # a plain number is still the mean over batches, then over ranks
            assert values["val/abs_y_mean"] == pytest.approx(result["mean_of_means"], rel=1e-6)
        assert result["resets"] >= 3  # two passes in fit, one in validate()
        assert result["best_checkpoint"] == "step_00000002"  # the same value: the first kept
    val = [r for r in results[0]["records"] if "val/abs_y" in r]
    assert [r["step"] for r in val] == [2, 4, 2]  # validate() records at the checkpoint's step
    assert set(val[0]) == {"step", "val/abs_y", "val/samples", "val/abs_y_mean"}
