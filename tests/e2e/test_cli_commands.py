"""`python -m manualpar` as a user runs it: exit codes and one-line errors, and the plan a
command writes read back by the recsys example (`train.py --plan-only`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import output_tail, run_python

from manualpar.cli import main
from manualpar.embeddings import EmbeddingPlan
from manualpar.embeddings.planning import load_topology

RECSYS_TRAIN = Path(__file__).resolve().parents[2] / "examples" / "recsys" / "train.py"
CRITEO_1TB = Path(__file__).resolve().parents[2] / "examples" / "plans" / "criteo_1tb_tables.json"


def _plan(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_inspect_reports_a_missing_checkpoint_in_one_line(tmp_path: Path) -> None:
    result = run_python("-m", "manualpar", "inspect", str(tmp_path / "no"), timeout=60)
    assert result.returncode == 2, output_tail(result)
    assert result.stderr.strip() == f"error: no checkpoint at {tmp_path / 'no'}"


def test_plan_error_exits_2_without_a_traceback(tmp_path: Path) -> None:
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps([{"name": "user", "num_embeddings": 10, "dim": 4}]))
    result = run_python(
        "-m", "manualpar", "plan", "--world-size", "2", "--tables", str(tables), timeout=60
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"error: --tables {tables}: entry 0 has unknown fields ['dim'] or "
        "lacks ['embedding_dim']; the fields are ['name', 'num_embeddings', "
        "'embedding_dim', 'feature_names', 'pooling', 'init_bound', 'dtype', 'raw_ids']\n"
    )


def _recsys_plan_only(out: Path, *args: str) -> None:
    run_python(RECSYS_TRAIN, "--plan-only", "2", "--out", str(out), *args, timeout=60, check=True)


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


def test_plan_reads_raw_ids_and_dtype_from_tables_json(tmp_path: Path) -> None:
    """tables.json as the recommender example writes it: dtype by name, raw_ids with its kind."""
    tables = tmp_path / "tables.json"
    entry = {"name": "user", "num_embeddings": 1000, "embedding_dim": 8, "dtype": "bf16"}
    hashed = {**entry, "raw_ids": {"kind": "hash", "salt": 3}}
    managed = {**entry, "name": "item", "raw_ids": {"kind": "managed", "policy": "lfu"}}
    tables.write_text(json.dumps([hashed, managed]))
    args = ("-m", "manualpar", "plan", "--world-size", "2", "--tables", str(tables))
    result = run_python(*args, timeout=60)
    assert result.returncode == 0, output_tail(result)
    # both replicated: the managed table's 16 buckets of 64 rows split 8 and 8 (24 bytes a row)
    assert "  managed-collision remappers per rank: r0: 12.0 KiB, r1: 11.4 KiB\n" in result.stdout
    tables.write_text(json.dumps([{**entry, "raw_ids": {"kind": "modulo"}}]))
    result = run_python(*args, timeout=60)
    assert result.returncode == 2, output_tail(result)
    assert result.stderr == (
        f"error: --tables {tables}: entry 0: raw_ids must be null or an object with kind "
        '\'hash\' or \'managed\' and its settings, e.g. {"kind": "hash", "salt": 0}; got '
        "{'kind': 'modulo'}\n"
    )


def test_calibrate_writes_a_topology_the_planner_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "host.json"
    args = ("--out", str(out), "--repeats", "1", "--size-mib", "16", "--disk-dir", str(tmp_path))
    result = run_python("-m", "manualpar", "calibrate", "--ranks-per-node", "2", *args, timeout=120)
    assert result.returncode == 0, output_tail(result)
    assert f"topology written to {out}" in result.stdout
    topology = load_topology(out, 4)
    assert (topology.name, topology.world_size, topology.ranks_per_node) == ("host", 4, 2)
    for field in ("memory_bandwidth", "intra_node_bandwidth", "disk_bandwidth"):
        assert getattr(topology, field) > 0, field
    assert list(tmp_path.iterdir()) == [out]  # the disk probe's file is gone
    code = main(["plan", "--world-size", "4", "--topology", str(out), "--table", "t:1000:8"])
    assert code == 0
    capsys.readouterr()
    assert main(["calibrate", "--repeats", "0"]) == 2
    assert capsys.readouterr().err == (
        "error: calibrate: --ranks-per-node and --repeats must be >= 1, --size-mib >= 16\n"
    )


PEAK_RSS = """
import resource, sys
from manualpar.cli import main
code = main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)  # KiB on Linux
sys.exit(code)
"""


def test_plan_on_thousands_of_ranks_stays_within_a_gib() -> None:
    """The 26 Criteo 1TB tables on 4,096 ranks with the bytes each rank sends: summed per
    owner, not in four ranks x ranks matrices (2.4 GB peak before, 8.7 GB on 8,192 ranks), and
    the planner keeps a bounded share of its candidates' costs (it kept them all: 7.9 GB for
    1,000 tables on 2,000 ranks)."""
    args = ("--tables", str(CRITEO_1TB), "--world-size", "4096", "--topology", "h100-nvlink-ndr")
    result = run_python("-c", PEAK_RSS, "plan", *args, "--batch-per-rank", "64", timeout=120)
    assert result.returncode == 0, output_tail(result)
    assert "bytes sent per rank and step (64 samples, 1 ids per bag): min " in result.stdout
    peak_kib = int(result.stderr.split()[-1])
    assert peak_kib < 2**20, f"peak resident memory {peak_kib / 2**20:.2f} GiB"
