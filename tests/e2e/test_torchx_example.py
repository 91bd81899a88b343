"""examples/torchx: the recommender under torchx's local_cwd, a failure on rank 1, one restart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from example_modules import load_example
from torchx.specs import AppState

import manualpar as mp


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("warm_launcher")  # torchrun and its workers start warm (conftest.py)
def test_recsys_fails_once_restarts_and_finishes(tmp_path: Path) -> None:
    example = load_example(Path("torchx/run_recsys.py"), "torchx_run_recsys")
    out = tmp_path / "out"
    app = example.recsys_app(
        out,
        steps=16,
        fail_at=12,
        checkpoint_every=8,
        train_args=(
            "--max-rows",
            "5000",
            "--batch",
            "256",
            "--val-samples",
            "1024",
            "--log-every",
            "4",
            "--no-progress",
            "--no-plot",
        ),
        env={"MANUALPAR_TIMEOUT_S": "30", "CUDA_VISIBLE_DEVICES": ""},
    )
    status, lines = example.run(app, tmp_path / "logs")
    log = "\n".join(lines)
    assert status.state == AppState.SUCCEEDED, f"{status}\n{log}"
    assert (out / "failed_once").read_text() == "rank 1 failed at step 12\n"
    assert "RuntimeError: injected failure on rank 1 at step 12" in log
    resumed = re.search(r"resuming from .*step_(\d+)", log)
    assert resumed is not None and int(resumed.group(1)) == 8, log
    assert "trained steps 8-16" in log
    assert mp.latest_checkpoint(out / "checkpoints") == out / "checkpoints" / "step_00000016"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 8, 12, 16, 16]  # the failed attempt's step 12 was dropped on resume
