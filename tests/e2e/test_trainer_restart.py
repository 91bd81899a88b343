"""A rank SIGKILLed mid-training under torchrun with a restart allowed: the job resumes from the
last checkpoint and ends with exactly the parameters of an uninterrupted run. The killed job is
a plain `python train.py` whose strategy starts its own 2 workers (`num_processes=2`,
`max_restarts=1`), which re-runs the script under torchrun: the uninterrupted job is started
with torchrun directly, so the test also holds the self-launch to torchrun's contract."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from launch import output_tail, run_python, run_torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_regression.py"


def _torchrun(out: Path, *args: str) -> None:
    run_torchrun(SCRIPT, "--out", str(out), *args, max_restarts=1, timeout=180, check=True)


def test_killed_rank_restart_resumes_to_identical_parameters(tmp_path: Path) -> None:
    _torchrun(tmp_path / "straight")
    killed_run = tmp_path / "killed"
    result = run_python(SCRIPT, "--out", str(killed_run), "--self-launch", "--kill-at", "6")
    assert result.returncode == 0, output_tail(result)
    assert (tmp_path / "straight" / "restarts.txt").read_text() == "0"
    assert (tmp_path / "killed" / "restarts.txt").read_text() == "1"
    straight = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    killed = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    for key, value in straight.items():
        assert torch.equal(value, killed[key]), key

    def losses(run: str) -> list[tuple[int, float]]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines)]

    assert losses("straight") == losses("killed")
