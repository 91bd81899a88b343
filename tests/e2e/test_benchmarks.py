"""The embedding benchmark runs end to end at toy size (numbers are not asserted: timing has no
place in tests), so it does not rot between the runs that produce docs' numbers."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from example_modules import EXAMPLES
from launch import run_python

BENCH = EXAMPLES / "benchmarks" / "bench_embeddings.py"
ROWS, TABLES, DIM, BATCH, IDS_PER_BAG = 3000, 2, 8, 64, 20  # the benchmark's default ids per bag
TOY = [
    "--rows",
    str(ROWS),
    "--tables",
    str(TABLES),
    "--dim",
    str(DIM),
    "--batch",
    str(BATCH),
    "--steps",
    "2",
    "--warmup",
    "1",
    "--repeats",
    "1",
]


# a pair's ratios: wall-clock step, CPU time per step, peak RSS, init (wall and CPU)
RATIOS = {"ms_per_step", "cpu_ms_per_step", "peak_rss", "init_s", "init_cpu_s", "pairs"}


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    run_python(BENCH, *TOY, *extra, "--json", str(out), timeout=240, check=True)
    return json.loads(out.read_text())


def _check_run(run: dict, plan: str, rows: int = ROWS) -> None:
    """One job's result: its median and throughput follow from its own step times."""
    assert run["plan"] == plan and len(run["step_ms"]) == 2
    assert len(run["peak_rss_gb_per_rank"]) == 2
    assert run["ms_per_step"] == statistics.median(run["step_ms"])
    # CPU time per step (every thread of the busiest rank), beside the wall clock
    assert len(run["step_cpu_ms"]) == 2 and all(ms > 0 for ms in run["step_cpu_ms"])
    assert run["cpu_ms_per_step"] == statistics.median(run["step_cpu_ms"])
    assert run["init_cpu_s"] > 0  # init's CPU time (every thread of the busiest rank)
    lookups = BATCH * TABLES * IDS_PER_BAG
    assert run["lookups_per_s"] == pytest.approx(lookups / (run["ms_per_step"] / 1000), rel=1e-12)
    assert run["table_gb"] == pytest.approx(TABLES * rows * DIM * 4 / 2**30, rel=1e-12)


@pytest.mark.timeout(300)
def test_compare_writes_ratios_for_both_plans_and_the_floor(tmp_path: Path) -> None:
    """manualpar, the plain-torch baseline, the floor (every lookup, no exchanges) and the step
    through TrainPipeline in one run: each job is a 2-process launch, so the suite starts them
    once."""
    result = _run(tmp_path, "--floor", "--pipelined")
    for plan in ("table_wise", "row_wise"):
        ratio = result["summary"][plan]["manualpar/baseline"]
        assert ratio["pairs"] == 1 and set(ratio) == RATIOS
        for name in ("manualpar", "baseline"):
            (run,) = result["runs"][plan][name]
            _check_run(run, plan)
        # one pair: each ratio is manualpar's number over the baseline's, from the raw runs
        (ours,) = result["runs"][plan]["manualpar"]
        (theirs,) = result["runs"][plan]["baseline"]
        (local,) = result["runs"][plan]["local"]
        (pipelined,) = result["runs"][plan]["pipelined"]
        _check_run(pipelined, plan)
        assert ratio["ms_per_step"] == pytest.approx(
            ours["ms_per_step"] / theirs["ms_per_step"], rel=1e-12
        )
        assert ratio["peak_rss"] == pytest.approx(
            max(ours["peak_rss_gb_per_rank"]) / max(theirs["peak_rss_gb_per_rank"]), rel=1e-12
        )
        assert ratio["init_s"] == pytest.approx(ours["init_s"] / theirs["init_s"], rel=1e-12)
        assert ratio["init_cpu_s"] == pytest.approx(
            ours["init_cpu_s"] / theirs["init_cpu_s"], rel=1e-12
        )
        assert ratio["cpu_ms_per_step"] == pytest.approx(
            ours["cpu_ms_per_step"] / theirs["cpu_ms_per_step"], rel=1e-12
        )
        assert result["summary"][plan]["median_ms_per_step"] == {
            "manualpar": ours["ms_per_step"],
            "baseline": theirs["ms_per_step"],
            "local": local["ms_per_step"],
            "pipelined": pipelined["ms_per_step"],
        }
        assert result["summary"][plan]["pipelined/local"]["ms_per_step"] == pytest.approx(
            pipelined["ms_per_step"] / local["ms_per_step"], rel=1e-12
        )
        floor = result["summary"][plan]["manualpar/local"]
        assert set(floor) == RATIOS
        assert floor["ms_per_step"] == pytest.approx(
            ours["ms_per_step"] / local["ms_per_step"], rel=1e-12
        )
        # 2 tables x global batch 64 x 20 ids, each looked up by exactly one of the two ranks
        assert local["ids_looked_up"] == 2 * 64 * 20 and len(local["step_ms"]) == 2
        # the memory floor (memory_floor.py): each variant's step as a multiple of it
        memory_floor = result["summary"][plan]["memory_floor"]
        assert memory_floor["ms"] > 0 and len(memory_floor["bytes_per_rank"]) == 2
        assert result["summary"][plan]["x_memory_floor"]["manualpar"] == pytest.approx(
            ours["ms_per_step"] / memory_floor["ms"], rel=1e-12
        )


@pytest.mark.timeout(300)
def test_scale_reports_each_size_against_the_first(tmp_path: Path) -> None:
    result = _run(tmp_path, "--scale", "--scale-gib", "0.001", "0.002")
    summary, runs = result["summary"], result["runs"]
    assert set(runs) == {"0.001GiB", "0.002GiB"} and all(len(r) == 1 for r in runs.values())
    first = statistics.median(r["ms_per_step"] for r in runs["0.001GiB"])
    for size, gib in (("0.001GiB", 0.001), ("0.002GiB", 0.002)):
        (run,) = runs[size]
        rows = int(gib * 2**30 / (TABLES * DIM * 4))  # tables of `gib` GiB in all
        _check_run(run, "table_wise", rows)
        median = statistics.median(r["ms_per_step"] for r in runs[size])
        assert summary[size]["median_ms_per_step"] == median
        # each size's median step time over the first size's, computed here from the raw times
        assert summary[size]["vs_0.001GiB"] == pytest.approx(median / first, rel=1e-12)
        assert summary[size]["max_peak_rss_gb"] == max(run["peak_rss_gb_per_rank"])
        state_gb = TABLES * rows * (DIM * 4 + 4) / 2**30  # weights + a row-wise optimizer sum
        assert summary[size]["rss_bound_gb"] == pytest.approx(state_gb / 2 + 0.5, rel=1e-12)
        assert summary[size]["median_init_s"] == run["init_s"]
        assert summary[size]["x_memory_floor"] == pytest.approx(
            median / summary[size]["memory_floor"]["ms"], rel=1e-12
        )
    assert summary["0.002GiB"]["rss_bound_gb"] > summary["0.001GiB"]["rss_bound_gb"]


@pytest.mark.timeout(120)
def test_kernel_benchmark_reports_each_table_size(tmp_path: Path) -> None:
    from manualpar.embeddings.kernels.native import native_kernels

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
