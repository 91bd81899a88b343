"""The examples run as a user runs them: torchrun, 2 processes, a few steps, and they learn."""

from __future__ import annotations

import re
from pathlib import Path

from example_modules import EXAMPLES
from launch import run_torchrun

import manualpar as mp


def _torchrun(script: str, *args: str) -> str:
    return run_torchrun(EXAMPLES / script, *args, nproc=2, timeout=120, check=True).stdout


def test_strategy_demo_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    out = _torchrun("strategy_demo.py", "--out", str(tmp_path), "--steps", "20", "--every", "10")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 2 and losses[-1] < losses[0]
    assert "parameters identical on all ranks: True" in out
    assert mp.latest_checkpoint(tmp_path) == tmp_path / "step_000020"
    resumed = _torchrun(
        "strategy_demo.py", "--out", str(tmp_path), "--steps", "30", "--every", "10"
    )
    assert "at step 20" in resumed and mp.latest_checkpoint(tmp_path) == tmp_path / "step_000030"
