"""`manualpar plan`, called in-process: placements, bytes per rank, one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from manualpar.cli import main
from manualpar.embeddings.planning import TOPOLOGY_PRESETS

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


def test_plan_memory_prints_placements_and_bytes_per_rank(capsys: pytest.CaptureFixture) -> None:
    code, out, err = _plan(capsys, "--world-size", "2", "--plan", "memory", *TABLES)
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
    assert lines[5] == ("predicted per step on cpu-host (2 ranks, 2 a node; 1024 samples a rank)")
    assert lines[7] == "  memory: r0: 24.8 MiB, r1: 12.4 MiB"
    assert len(lines) == 10


def test_plan_auto_prints_each_choice_its_cost_and_its_runner_up(
    capsys: pytest.CaptureFixture,
) -> None:
    code, out, err = _plan(capsys, "--world-size", "2", *TABLES)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    for line, name in zip(lines[1:4], ("user", "item", "country"), strict=True):
        assert line.split()[0] == name
        assert re.search(
            r"\(slowest rank \+[0-9.]+ ms, up to [0-9.]+ KiB sent a rank; runner-up "
            r"[a-z_]+(\[[0-9, ]+\])?: (slowest rank [0-9.e-]+ ms slower|as slow a slowest rank)",
            line,
        ), line
    step = next(line for line in lines if line.startswith("  step time (embeddings): "))
    memory_plan = _plan(capsys, "--world-size", "2", "--plan", "memory", *TABLES)[1]
    old_step = next(
        line for line in memory_plan.splitlines() if line.startswith("  step time (embeddings): ")
    )

    def slowest(line: str) -> float:
        return max(float(t) for t in re.findall(r"r\d+: ([0-9.]+) ms", line))

    assert slowest(step) <= slowest(
        old_step
    )  # the model's pick beats memory-only, by its own measure


def test_plan_builders_count_the_optimizers_state(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _plan(
        capsys,
        "--world-size",
        "2",
        "--plan",
        "column_wise",
        "--rule",
        "adam",
        "--table",
        "user:100000:64",
        "--table",
        "item:50000:64",
    )
    assert code == 0
    assert "r0:rows[0:100000]cols[0:32], r1:rows[0:100000]cols[32:64]" in out
    assert (
        "\n  bytes per rank (weights + Adam state): r0: 54.9 MiB, r1: 54.9 MiB\n" in out
    )  # 150000 rows x 32 columns x 3 floats
    assert "\n  memory: r0: 54.9 MiB, r1: 54.9 MiB\n" in out  # the cost model agrees
    code, out, _ = _plan(
        capsys,
        "--world-size",
        "4",
        "--ranks-per-node",
        "2",
        "--plan",
        "table_row_wise",
        "--rule",
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
    assert (
        "\n  bytes per rank (weights only, SGD keeps no state): "
        "r0: 12.2 MiB, r1: 12.2 MiB, r2: 3.7 MiB, r3: 3.7 MiB\n"
    ) in out


def test_plan_optimizer_is_the_rule_before_0_3_with_a_warning(
    capsys: pytest.CaptureFixture,
) -> None:
    args = ("--world-size", "2", "--plan", "column_wise", "--table", "user:100000:64")
    code, new, _ = _plan(capsys, *args, "--rule", "adam")
    with pytest.warns(FutureWarning, match=r"plan --optimizer was renamed .*plan --rule"):
        old_code, old, _ = _plan(capsys, *args, "--optimizer", "adam")
    assert (old_code, old) == (code, new)
    assert code == 0 and "weights + Adam state" in new
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--optimizer" not in capsys.readouterr().out  # hidden: --rule is the documented one


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
            "auto, memory, table_wise, row_wise, column_wise, table_row_wise, data_parallel",
        ),
        (
            ["--table", "user:10:4", "--memory-budget", "2 lots"],
            "error: --memory-budget '2 lots': "
            "expected a positive size such as 2GiB, 512MiB, 1.5GB or plain bytes",
        ),
        (
            ["--table", "user:10:4", "--rule", "lamb"],
            "error: --rule 'lamb': expected one of rowwise_adagrad, adagrad, adam, sgd",
        ),
        (
            ["--table", "user:10:4", "--rule", "sgd", "--optimizer", "sgd"],
            "error: --optimizer is --rule's spelling before 0.3: pass --rule alone",
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
            "error: table 'user' holds 2.42 GiB with optimizer state: at least 1.21 GiB per "
            "rank on 2 ranks, more than the budget of 1.00 GiB; raise the memory budget to "
            "1.21 GiB or more, use 3 or more ranks, or shrink the tables",
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
            "than the memory budget of 2.00 GiB; try plan 'auto', more ranks or a larger "
            "budget",
        ),
    ],
)
def test_plan_errors_are_one_line(
    capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    code, out, err = _plan(capsys, "--world-size", "2", *args)
    assert (code, out, err) == (2, "", message + "\n")


def test_plan_lowers_a_precision_only_where_the_budget_forces_it(
    capsys: pytest.CaptureFixture,
) -> None:
    tables = ("--table", "huge:1000000:64", "--table", "small:50000:64")
    args = ("--world-size", "2", *tables, "--memory-budget", "100MiB")
    code, out, _ = _plan(capsys, *args, "--precisions", "fp32,bf16")
    assert code == 0
    huge, small = out.splitlines()[1:3]
    assert huge.split()[:5] == ["huge", "1000000", "x", "64", "bf16"]
    assert "(in bf16: in fp32 it would exceed the 100.0 MiB budget per rank;" in huge
    assert small.split()[4] != "bf16"  # fp32 fits for it
    code, _, err = _plan(capsys, *args)
    assert code == 2 and "budget" in err
    code, _, err = _plan(capsys, *args, "--plan", "row_wise", "--precisions", "fp32,bf16")
    assert (code, err) == (2, "error: --precisions: only --plan auto chooses precisions\n")
    for extra in (("--pin", "huge=disk"), ("--disk-cache", "10MiB")):  # once silently ignored
        code, out, err = _plan(capsys, *args, "--precisions", "fp32,bf16", *extra)
        assert (code, out) == (2, "")
        assert err.startswith("error: --precisions with --disk-cache or --pin: the precision")


def test_replicas_auto_compares_layouts_and_names_those_that_do_not_fit(
    capsys: pytest.CaptureFixture,
) -> None:
    args = ("--world-size", "4", "--table", "a:400000:64", "--table", "b:100000:64")
    code, out, _ = _plan(capsys, *args, "--replicas", "auto", "--memory-budget", "64MiB")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "layouts (predicted slowest rank, fullest rank's memory):"
    names = [
        line.split()[0] + (" " + line.split()[1] if line.startswith("  2-D") else "")
        for line in lines[1:4]
    ]
    assert names == ["1-D", "2-D 2", "2-D 4"]
    assert sum("<- chosen" in line for line in lines[1:4]) == 1
    assert "does not fit: the 2 tables" in lines[3]  # a whole copy on every rank: 124 MiB
    code, _, err = _plan(capsys, *args, "--replicas", "3")
    assert code == 2 and err.startswith("error: --replicas '3': expected auto or a count")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--table", f"user:{10**29}:4"],
            f"error: table 'user': num_embeddings must be at most 2**63 - 1 (a tensor's sizes "
            f"are int64), got {10**29}",
        ),
        (
            ["--table", "user:10:4", "--batch-per-rank", "0"],
            "error: --batch-per-rank 0: expected samples a rank per step, at least 1",
        ),
        (
            ["--table", "user:10:4", "--ids-per-bag", "inf"],
            "error: --ids-per-bag inf: expected a finite mean >= 0",
        ),
        (
            ["--table", "user:10:4", "--skew", "nan"],
            "error: --skew nan: expected 0 (uniform) or a finite Zipf exponent > 0",
        ),
    ],
)
def test_plan_refuses_values_out_of_range(
    capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    code, out, err = _plan(capsys, "--world-size", "2", *args)
    assert (code, out, err) == (2, "", message + "\n")


@pytest.mark.parametrize("speed", ["NaN", "Infinity", "-Infinity"])
def test_plan_refuses_a_topology_with_a_speed_that_is_not_finite(
    capsys: pytest.CaptureFixture, tmp_path: Path, speed: str
) -> None:
    fields = {**TOPOLOGY_PRESETS["cpu-host"], "memory_bandwidth": "SPEED"}
    path = tmp_path / "host.json"
    path.write_text(json.dumps(fields).replace('"SPEED"', speed))
    code, out, err = _plan(capsys, "--world-size", "2", "--topology", str(path), *TABLES)
    value = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[speed]
    assert (code, out) == (2, "")
    assert err == (
        f"error: --topology: topology 'host': memory_bandwidth must be a finite number >= 0, "
        f"got {value}; measure the host with `python -m manualpar calibrate --out FILE`\n"
    )


def test_plan_refuses_a_table_name_with_an_unprintable_character(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    path = tmp_path / "tables.json"
    path.write_text(json.dumps([{"name": "us\u0000er", "num_embeddings": 10, "embedding_dim": 4}]))
    code, out, err = _plan(capsys, "--world-size", "2", "--tables", str(path))
    assert (code, out) == (2, "")
    assert err == (
        f"error: --tables {path}: entry 0: table name 'us\\x00er' must be a non-empty string "
        "without '/', '.' or unprintable characters\n"
    )
