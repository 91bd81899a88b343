"""The embedding benchmark runs end to end at toy size (numbers are not asserted: timing has no
place in tests), so it does not rot between the runs that produce docs' numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from example_modules import EXAMPLES
from launch import run_python

BENCH = EXAMPLES / "benchmarks" / "bench_embeddings.py"
TOY = [
    "--rows",
    "3000",
    "--tables",
    "2",
    "--dim",
    "8",
    "--batch",
    "64",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--repeats",
    "1",
]


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    run_python(BENCH, *TOY, *extra, "--json", str(out), timeout=240, check=True)
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_compare_writes_ratios_for_both_plans(tmp_path: Path) -> None:
    result = _run(tmp_path)
    for plan in ("table_wise", "row_wise"):
        ratio = result["summary"][plan]["manualpar/baseline"]
        assert ratio["pairs"] == 1 and set(ratio) == {"ms_per_step", "peak_rss", "init_s", "pairs"}
        for name in ("manualpar", "baseline"):
            (run,) = result["runs"][plan][name]
            assert run["plan"] == plan and len(run["step_ms"]) == 2
            assert len(run["peak_rss_gb_per_rank"]) == 2


@pytest.mark.timeout(300)
def test_floor_runs_every_lookup_without_exchanges(tmp_path: Path) -> None:
    result = _run(tmp_path, "--floor", "--skip-baseline")
    for plan in ("table_wise", "row_wise"):
        assert set(result["summary"][plan]["manualpar/local"]) == {
            "ms_per_step",
            "peak_rss",
            "init_s",
            "pairs",
        }
        (run,) = result["runs"][plan]["local"]
        # 2 tables x global batch 64 x 20 ids, each looked up by exactly one of the two ranks
        assert run["ids_looked_up"] == 2 * 64 * 20 and len(run["step_ms"]) == 2


@pytest.mark.timeout(300)
def test_scale_reports_each_size_against_the_first(tmp_path: Path) -> None:
    result = _run(tmp_path, "--scale", "--scale-gib", "0.001", "0.002")
    summary = result["summary"]
    assert summary["0.001GiB"]["vs_0.001GiB"] == 1.0
    assert summary["0.002GiB"]["rss_bound_gb"] > summary["0.001GiB"]["rss_bound_gb"]
    assert len(result["runs"]["0.002GiB"]) == 1


@pytest.mark.timeout(120)
def test_kernel_benchmark_reports_each_table_size(tmp_path: Path) -> None:
    from manualpar.embeddings.native import native_kernels

    if native_kernels() is None:
        pytest.skip("the C++ kernels could not be built on this machine")
    out = tmp_path / "kernels.json"
    script = BENCH.parent / "bench_embedding_kernels.py"
    run_python(
        script,
        *("--rows", "5000", "20000", "--bags", "64", "--repeats", "2", "--warmup", "1"),
        *("--json", str(out)),
        timeout=100,
        check=True,
    )
    results = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in results] == [5000, 20000]
    for result in results:
        assert {"lookup_ms", "group_ms", "update_ms", "update_vs_lookup"} <= set(result)
        assert all(len(samples) == 2 for samples in result["samples"].values())
