"""The examples run as a user runs them: torchrun, 2 processes, a few steps, and they learn."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import manualpar as mp

EXAMPLES = Path(__file__).parent.parent / "examples"


def _env() -> dict[str, str]:
    """The caller's environment without launcher variables (the examples get torchrun's)."""
    return {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_PORT"}}


def _torchrun(script: str, *args: str) -> str:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / script),
        *args,
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "MANUALPAR_TIMEOUT_S": "30", "CUDA_VISIBLE_DEVICES": ""},
    )  # the CPU/gloo path everywhere
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


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
