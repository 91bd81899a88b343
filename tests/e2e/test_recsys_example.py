"""The recommender example as a user runs it: it learns on 2 ranks under torchrun (checkpoints,
metrics, plot) and on a Criteo TSV file in one process."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from example_modules import EXAMPLES, load_example
from launch import run_python, run_torchrun
from png_checks import assert_plots_every_metric

import manualpar as mp

RECSYS = EXAMPLES / "recsys"
data = load_example(Path("recsys/data.py"), "recsys_data")


def _train(*args: str, ranks: int = 2) -> str:
    """train.py under torchrun on `ranks` processes, or as a plain single process."""
    if ranks > 1:
        result = run_torchrun(RECSYS / "train.py", *args, nproc=ranks, timeout=120, check=True)
    else:
        result = run_python(RECSYS / "train.py", *args, timeout=120, check=True)
    return result.stdout


def test_trains_on_two_ranks_checkpoints_and_plots(tmp_path: Path) -> None:
    out = _train(
        "--out",
        str(tmp_path),
        "--steps",
        "40",
        "--batch",
        "512",
        "--max-rows",
        "20000",
        "--val-every",
        "20",
        "--val-samples",
        "4096",
        "--log-every",
        "10",
        "--checkpoint-every",
        "20",
        "--no-progress",
    )
    assert "embedding plan for 2 ranks" in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    aucs = [r["val/auc"] for r in records if "val/auc" in r]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.05
    assert {r["sparse_optim/lr"] for r in records if "loss" in r} == {0.05}  # --emb-lr default
    assert len(aucs) == 2 and aucs[-1] > 0.6
    final = float(re.search(r"validation AUC (\d\.\d+)", out).group(1))
    assert math.isclose(final, aucs[-1], abs_tol=1e-4)  # the final evaluation: same model
    assert mp.latest_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints/step_00000040"
    assert_plots_every_metric(tmp_path / "metrics.png", tmp_path / "metrics.jsonl")


def test_trains_on_a_criteo_tsv_file_in_one_process(tmp_path: Path) -> None:
    source = data.SyntheticCriteo(data.table_rows(max_rows=20000), seed=0)
    data.write_criteo_tsv(tmp_path / "day.tsv", data.synthetic_records(source, 0, 4000))
    out = _train(
        "--criteo",
        str(tmp_path / "day.tsv"),
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "12",
        "--batch",
        "256",
        "--max-rows",
        "20000",
        "--val-samples",
        "1024",
        "--val-every",
        "6",
        "--no-progress",
        "--no-plot",
        ranks=1,
    )
    assert "embedding plan for 1 ranks" in out
    assert float(re.search(r"validation AUC (\d\.\d+)", out).group(1)) > 0.55
