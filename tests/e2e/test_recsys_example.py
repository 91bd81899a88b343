"""The recommender example as a user runs it: it learns on 2 ranks under torchrun (checkpoints,
metrics, plot) and on Criteo-format files streamed into raw-id tables."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from example_modules import EXAMPLES, load_example
from launch import run_python, run_torchrun
from png_checks import assert_plots_every_metric

import manualpar as mp

RECSYS = EXAMPLES / "recsys"
data = load_example(Path("recsys/data.py"), "recsys_data")
criteo = load_example(Path("recsys/write_criteo.py"), "recsys_write_criteo", {"data": data})


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


@pytest.mark.parametrize("raw_ids", ["hash", "lru"])
def test_trains_on_criteo_files_on_two_ranks(tmp_path: Path, raw_ids: str) -> None:
    """Streamed from a gzip and a plain file (one per rank) into raw-id tables (hashed, or with
    managed collisions), validated on a third file; the shares are whole files of equal
    length, so training ends with the data."""
    files = [
        criteo.write_synthetic_criteo(tmp_path / name, lines, start=start, max_rows=2000)
        for name, lines, start in (
            ("day_0.gz", 5120, 0),
            ("day_1", 5120, 5120),
            ("val", 2048, 10240),
        )
    ]
    out = _train(
        "--criteo",
        str(files[0]),
        str(files[1]),
        "--criteo-val",
        str(files[2]),
        "--rows-per-table",
        "4096",
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "100",
        "--batch",
        "256",
        "--val-samples",
        "2048",
        "--val-every",
        "20",
        "--log-every",
        "10",
        "--no-progress",
        "--no-plot",
        "--raw-ids",
        raw_ids,
    )
    assert "embedding plan for 2 ranks" in out
    tables = json.loads((tmp_path / "run/tables.json").read_text())
    expected = [
        {"kind": "hash", "salt": i}
        if raw_ids == "hash"
        else {"kind": "managed", "policy": raw_ids, "salt": i, "bucket_rows": 64}
        for i in range(26)
    ]
    assert [t["raw_ids"] for t in tables] == expected
    metrics = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    rates = [r for r in map(json.loads, metrics) if "raw_ids/eviction_rate" in r]
    assert bool(rates) == (raw_ids != "hash")  # managed tables: the Trainer logs their rates
    for record in rates:
        assert 0 <= record["raw_ids/eviction_rate"] <= record["raw_ids/collision_rate"] <= 1
    assert {t["num_embeddings"] for t in tables} == {4096}
    assert "trained steps 0-40" in out  # 5120 lines per rank, 128 per rank and step
    assert float(re.search(r"validation AUC (\d\.\d+)", out).group(1)) > 0.65


def test_criteo_bad_lines_policy_from_the_command_line(tmp_path: Path) -> None:
    """--criteo-bad-lines skip trains past 2 malformed lines and a blank one and reports the
    count; the default refuses the first malformed line, naming it."""
    day = criteo.write_synthetic_criteo(tmp_path / "good", 3000, max_rows=500)
    lines = day.read_text().splitlines(keepends=True)
    broken = tmp_path / "day_0"
    broken.write_text("".join([*lines[:1500], "1\tx\n", "\n", *lines[1500:], "2" + lines[0][1:]]))
    args = ["--criteo", str(broken), "--rows-per-table", "512", "--steps", "4", "--batch", "256",
            "--val-samples", "512", "--val-every", "4", "--log-every", "2", "--no-progress",
            "--no-plot"]  # fmt: skip
    out = _train(*args, "--out", str(tmp_path / "skip"), "--criteo-bad-lines", "skip",
                 "--criteo-max-bad-share", "0.01", ranks=1)  # fmt: skip
    assert "criteo: skipped 2 malformed lines of 3002 read (all ranks)" in out
    assert "trained steps 0-4" in out
    refused = run_python(RECSYS / "train.py", *args, "--out", str(tmp_path / "raise"), timeout=120)
    assert refused.returncode != 0
    assert f"DataFileError: {broken}, line 1501: expected 40 tab-separated fields" in (
        refused.stderr + refused.stdout
    )
