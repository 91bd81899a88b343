"""`python -m manualpar` on real checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_models import make_model

import manualpar as mp
from manualpar.cli import main
from manualpar.embeddings import EmbeddingPlan


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    strategy = mp.ManualParallelStrategy()
    model = make_model(seed=0)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "step": 7}
    strategy.save_checkpoint(tmp_path / "step_7", state)
    strategy.save_checkpoint(tmp_path / "full.pt", state, full=True)
    return tmp_path


def test_inspect_sharded_checkpoint(checkpoints: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(checkpoints / "step_7")]) == 0
    out = capsys.readouterr().out
    assert "kind sharded, step 7, saved by 1 rank(s)" in out
    assert "entries: model (module), optim (optimizer), step (value)" in out
    assert [line.split()[:2] for line in out.splitlines() if "model/0.weight" in line] == [
        ["model/0.weight", "8x4"]
    ]


def test_inspect_json_of_full_export(checkpoints: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", "--json", str(checkpoints / "full.pt")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "full" and info["step"] == 7 and info["world_size"] == 1
    assert info["tensors"]["model/2.weight"] == {
        "shape": [2, 8],
        "dtype": "torch.float32",
        "chunks": 1,
    }


def test_inspect_reports_a_missing_checkpoint_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "manualpar", "inspect", str(tmp_path / "no")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: no checkpoint at {tmp_path / 'no'}"


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    records = [{"step": s, "loss": 1.0 / s, "lr": 0.1} for s in range(1, 6)]
    records.append({"step": 5, "val/loss": 0.3})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_plot_without_metrics_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: no metrics.jsonl in {tmp_path}; pass the Trainer's out_dir"
    )


# ---- plan ---------------------------------------------------------------------------------------
RECSYS_TRAIN = Path(__file__).parent.parent / "examples" / "recsys" / "train.py"
TABLES = [
    "--table",
    "user:100000:64",
    "--table",
    "item:50000:64:item,last_item",
    "--table",
    "country:200:16",
]


def _plan(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_auto_prints_placements_and_bytes_per_rank(capsys: pytest.CaptureFixture) -> None:
    code, out, err = _plan(capsys, "--world-size", "2", *TABLES)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "embedding plan for 2 ranks"
    assert [line.split()[:5] for line in lines[1:4]] == [
        ["user", "100000", "x", "64", "row_wise"],
        ["item", "50000", "x", "64", "table_wise[0]"],
        ["country", "200", "x", "16", "data_parallel"],
    ]
    assert (
        "r0:rows[0:50000], r1:rows[50000:100000]  (rows split over all 2 ranks (larger than "
        "an even share; 12.4 MiB each))" in lines[1]
    )
    assert lines[2].endswith("r0:rows[0:50000]  (whole on rank 0 (12.4 MiB; least-loaded rank))")
    assert lines[4] == "  bytes per rank (weights + row-wise state): r0: 24.8 MiB, r1: 12.4 MiB"
    assert len(lines) == 5


def test_plan_builders_count_the_optimizers_state(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _plan(
        capsys,
        "--world-size",
        "2",
        "--plan",
        "column_wise",
        "--optimizer",
        "adam",
        "--table",
        "user:100000:64",
        "--table",
        "item:50000:64",
    )
    assert code == 0
    assert "r0:rows[0:100000]cols[0:32], r1:rows[0:100000]cols[32:64]" in out
    assert (
        out.splitlines()[-1] == "  bytes per rank (weights + Adam state): r0: 54.9 MiB, "
        "r1: 54.9 MiB"
    )  # 150000 rows x 32 columns x 3 floats
    code, out, _ = _plan(
        capsys,
        "--world-size",
        "4",
        "--ranks-per-node",
        "2",
        "--plan",
        "table_row_wise",
        "--optimizer",
        "sgd",
        "--table",
        "user:100000:64",
        "--table",
        "item:60000:32",
    )
    assert code == 0
    assert [line.split()[4:] for line in out.splitlines()[1:3]] == [
        ["table_row_wise[0,", "1]", "r0:rows[0:50000],", "r1:rows[50000:100000]"],
        ["table_row_wise[2,", "3]", "r2:rows[0:30000],", "r3:rows[30000:60000]"],
    ]
    assert out.splitlines()[-1] == (
        "  bytes per rank (weights only, SGD keeps no state): "
        "r0: 12.2 MiB, r1: 12.2 MiB, r2: 3.7 MiB, r3: 3.7 MiB"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--table", "user:abc:64"],
            "error: --table 'user:abc:64': expected NAME:ROWS:DIM"
            "[:FEATURE,...] with integer ROWS and DIM, e.g. user:1000000:64 or "
            "item:500000:64:item,last_item",
        ),
        (
            ["--table", "user:10:4", "--plan", "diagonal"],
            "error: --plan 'diagonal': expected one of "
            "auto, table_wise, row_wise, column_wise, table_row_wise, data_parallel",
        ),
        (
            ["--table", "user:10:4", "--memory-budget", "2 lots"],
            "error: --memory-budget '2 lots': "
            "expected a positive size such as 2GiB, 512MiB, 1.5GB or plain bytes",
        ),
        (
            ["--table", "user:10:4", "--optimizer", "lamb"],
            "error: --optimizer 'lamb': expected one of rowwise_adagrad, adagrad, adam, sgd",
        ),
        (
            [],
            "error: no tables: pass --table NAME:ROWS:DIM[:FEATURE,...] (repeatable) or --tables "
            "FILE",
        ),
        (
            ["--table", "user:10:4", "--table", "user:20:4"],
            "error: table names must be unique; repeated: ['user']",
        ),
        (
            ["--table", "user:10000000:64", "--memory-budget", "1GiB"],
            "error: the table holds 2.42 GiB with optimizer state: at least 1.21 GiB per rank on 2 "
            "ranks, more than the budget of 1.00 GiB; raise the memory budget to 1.21 GiB or more, "
            "use 3 or more ranks, or shrink the tables",
        ),
        (
            [
                "--table",
                "user:10000000:64",
                "--table",
                "item:10:4",
                "--plan",
                "table_wise",
                "--memory-budget",
                "2147483648",
            ],
            "error: plan table_wise puts 2.42 GiB on rank 0, more "
            "than the memory budget of 2.00 GiB; try --plan auto, more ranks or a larger "
            "--memory-budget",
        ),
    ],
)
def test_plan_errors_are_one_line(
    capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    code, out, err = _plan(capsys, "--world-size", "2", *args)
    assert (code, out, err) == (2, "", message + "\n")


def test_plan_error_exits_2_without_a_traceback(tmp_path: Path) -> None:
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps([{"name": "user", "num_embeddings": 10, "dim": 4}]))
    result = subprocess.run(
        [sys.executable, "-m", "manualpar", "plan", "--world-size", "2", "--tables", str(tables)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"error: --tables {tables}: entry 0 has unknown fields ['dim'] or "
        "lacks ['embedding_dim']; the fields are ['name', 'num_embeddings', "
        "'embedding_dim', 'feature_names', 'pooling', 'init_bound']\n"
    )


def _recsys_plan_only(out: Path, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, str(RECSYS_TRAIN), "--plan-only", "2", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_plan_json_round_trips_through_the_recsys_example(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _recsys_plan_only(tmp_path / "example")  # writes its tables.json and its own auto plan
    tables = str(tmp_path / "example" / "tables.json")
    auto = tmp_path / "auto.json"
    assert _plan(capsys, "--world-size", "2", "--tables", tables, "--json", str(auto))[0] == 0
    assert auto.read_text() == (tmp_path / "example" / "plan.json").read_text()  # same planner
    row_wise = tmp_path / "row_wise.json"
    code, out, _ = _plan(
        capsys,
        "--world-size",
        "2",
        "--tables",
        tables,
        "--plan",
        "row_wise",
        "--json",
        str(row_wise),
    )
    assert code == 0 and out.splitlines()[-1] == f"plan written to {row_wise}"
    plan = EmbeddingPlan.from_json(row_wise.read_text())
    assert plan.world_size == 2 and len(plan.tables) == 26
    assert {str(p) for p in plan.tables.values()} == {"row_wise"}
    assert EmbeddingPlan.from_json(plan.to_json()) == plan
    _recsys_plan_only(tmp_path / "reloaded", "--plan", str(row_wise))  # train.py --plan FILE
    assert EmbeddingPlan.from_json((tmp_path / "reloaded" / "plan.json").read_text()) == plan
