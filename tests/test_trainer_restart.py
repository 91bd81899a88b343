"""A rank SIGKILLed mid-training under torchrun with a restart allowed: the job resumes from the
last checkpoint and ends with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = str(Path(__file__).parent / "scripts" / "train_regression.py")


def _torchrun(out: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_PORT"}}
    env.update(MANUALPAR_TIMEOUT_S="30", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            SCRIPT,
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_killed_rank_restart_resumes_to_identical_parameters(tmp_path: Path) -> None:
    _torchrun(tmp_path / "straight")
    _torchrun(tmp_path / "killed", "--kill-at", "6")
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
