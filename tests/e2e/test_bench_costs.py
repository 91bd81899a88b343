"""The cost benchmarks (the pipeline, the half-row guard, raw ids, row checksums, the disk tier,
step times) run end to end at toy size and write consistent JSON (numbers are not asserted:
timing has no place in tests)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from example_modules import EXAMPLES
from launch import run_python, run_torchrun

from manualpar.loop.step_times import PHASES

TOY = ("--rows", "500", "--tables", "2", "--batch", "64", "--steps", "2", "--warmup", "1")


def _two_ranks(tmp_path: Path, script: str, *args: str) -> dict:
    """A benchmark run on 2 ranks under torchrun; the JSON it wrote."""
    out = tmp_path / "result.json"
    run_torchrun(
        EXAMPLES / "benchmarks" / script,
        *args,
        *("--json", str(out)),
        nproc=2,
        timeout=120,
        check=True,
    )
    return json.loads(out.read_text())


def _one_process(tmp_path: Path, script: str, *args: str) -> dict:
    """A benchmark run as one plain process (which may launch its own jobs); its JSON."""
    out = tmp_path / "result.json"
    run_python(EXAMPLES / "benchmarks" / script, *args, "--json", str(out), timeout=180, check=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    ("script", "variants"),
    [
        ("bench_pipeline.py", ("plain", "pipelined")),
        ("bench_half_guard.py", ("unguarded", "guarded")),
    ],
)
def test_two_rank_cost_benchmarks_report_their_median_ratio(
    tmp_path: Path, script: str, variants: tuple[str, str]
) -> None:
    result = _two_ranks(tmp_path, script, *TOY, "--repeats", "2")
    base, candidate = variants
    assert len(result["repeats"]) == 2
    ratios = [r[f"{candidate}_ms"] / r[f"{base}_ms"] for r in result["repeats"]]
    assert result["ratio"] == pytest.approx(statistics.median(ratios))
    assert result[f"{base}_ms"] == pytest.approx(
        statistics.median(r[f"{base}_ms"] for r in result["repeats"])
    )


def test_finite_check_benchmark_reports_each_variant_against_checked(tmp_path: Path) -> None:
    """Its stand-ins replace the step's FiniteCheck: they must still fit where it sits."""
    result = _two_ranks(tmp_path, "bench_finite_check.py", *TOY, "--repeats", "1")
    summary = result["summary"]
    assert list(summary) == ["checked", "unchecked", "sum_only", "late_wait"]
    assert summary["checked"]["vs_checked"] == 1.0
    assert all(row["median_ms"] > 0 for row in summary.values())


def test_raw_ids_benchmark_reports_every_variant_against_rows(tmp_path: Path) -> None:
    result = _two_ranks(
        tmp_path, "bench_raw_ids.py", *TOY, "--bucket-rows", "8", "--repeats", "2", "--pipelined"
    )
    variants = result["variants"]
    assert list(variants) == [
        "rows",
        "hash",
        "managed",
        "managed-torch",
        "rows-pipelined",
        "managed-pipelined",
    ]
    repeats = result["repeats"]
    assert len(repeats) == 2
    for name, summary in variants.items():
        assert summary["ratio_to_rows"] == pytest.approx(
            statistics.median(r[f"{name}_ms"] / r["rows_ms"] for r in repeats)
        )
    assert variants["managed-pipelined"]["ratio_to_rows_pipelined"] == pytest.approx(
        statistics.median(r["managed-pipelined_ms"] / r["rows-pipelined_ms"] for r in repeats)
    )
    # 500 rows in buckets of 8 against raw ids from 4x as many: some ids collide
    assert 0 < result["managed_collision_rate"] < 1


def test_step_times_benchmark_reports_each_interval_against_off(tmp_path: Path) -> None:
    result = _two_ranks(tmp_path, "bench_step_times.py", *TOY, "--repeats", "2")
    repeats = result["repeats"]
    assert len(repeats) == 2
    for name in ("every_10", "every_step"):
        assert result["ratio"][name] == pytest.approx(
            statistics.median(r[f"{name}_ms"] / r["off_ms"] for r in repeats)
        )
    for fits in (r["fits"] for r in repeats):
        assert fits["every_step"]["ms"] == fits["every_step"]["timed_ms"]
        # 2 measured steps (1 and 2): all timed, or none of them under every 10th
        assert [fits[n]["timed_steps"] for n in ("off", "every_10", "every_step")] == [0, 0, 2]
    assert set(result["breakdown_ms"]) == {f"time/{n}" for n in (*PHASES, "step")}


def test_row_checksum_benchmark_reports_the_cost_per_step(tmp_path: Path) -> None:
    result = _one_process(
        tmp_path,
        "bench_row_checksum.py",
        *("--rows", "5000", "--rows-per-step", "300", "--steps", "2", "--repeats", "2"),
    )
    plain, checked = (statistics.median(result[k]) for k in ("plain_ms", "checksum_ms"))
    assert result["ratio"] == pytest.approx(checked / plain)
    assert result["extra_ms_per_step"] == pytest.approx(checked - plain)
    assert result["record_bytes"] == 64 * 4 + 4  # 64 float32 weights and a row-wise sum


def test_row_writes_benchmark_reports_each_way_against_the_scattered_writes(
    tmp_path: Path,
) -> None:
    memory = "/dev/shm" if Path("/dev/shm").is_dir() else str(tmp_path)  # a memory file system
    result = _one_process(
        tmp_path,
        "bench_row_writes.py",
        *("--rows", "4000", "--rows-per-step", "300", "--steps", "2", "--repeats", "3"),
        *("--dir", str(tmp_path), "--memory-dir", memory),
    )
    steps = result["ms_per_step"]
    assert set(steps) == {"scattered", "scattered-memory", "sequential"}
    for way, times in steps.items():
        assert len(times) == 3
        ratios = [a / b for a, b in zip(times, steps["scattered"], strict=True)]
        assert result["ratio_to_scattered"][way] == pytest.approx(statistics.median(ratios))
        per_row = statistics.median(times) / 1e3 / 300 * 1e6
        assert result["us_per_row"][way] == pytest.approx(per_row)
    assert result["record_bytes"] == 64 * 4 + 4
    assert list(tmp_path.iterdir()) == [tmp_path / "result.json"]  # its row files are gone


def test_planner_benchmark_measures_the_pick_beside_the_plans_it_ranked_lower(
    tmp_path: Path,
) -> None:
    result = _two_ranks(
        tmp_path,
        "bench_planner.py",
        *("--row-scale", "0.001", "--batch", "64", "--steps", "1", "--warmup", "1"),
        *("--repeats", "2"),
    )
    names = list(result["plans"])
    assert names[0] == "auto" and {"memory", "table_wise", "row_wise", "column_wise"} <= set(names)
    assert result["ratio_to_pick"]["auto"] == 1.0
    for name in names:
        assert result["measured_ms"][name] == pytest.approx(
            statistics.median(r[name] for r in result["repeats_ms"])
        )
        assert result["predicted_ms"][name] > 0
        assert result["plans"][name]["world_size"] == 2


def test_disk_tier_benchmark_reports_the_pipelined_step_against_memory(tmp_path: Path) -> None:
    result = _one_process(
        tmp_path,
        "bench_disk_tier.py",
        *("--disk-gb", "0.02", "--memory-gb", "0.01", "--cache-gb", "0.002", "--batch", "512"),
        *("--warmup", "2", "--max-warmup", "40", "--steps", "2", "--repeats", "1"),
        *("--variants", "memory", "lru-pipelined", "--dir", str(tmp_path / "tables")),
        *("--shift-every", "3"),  # the hot rows move during the warm-up
    )
    (memory,) = result["runs"]["memory"]
    (piped,) = result["runs"]["lru-pipelined"]
    assert piped["variant"] == "lru-pipelined" and memory["hit_rate"] is None
    assert 0 < piped["hit_rate"] < 1 and piped["evicted_rows"] > 0  # the cache was full
    summary = result["summary"]["lru-pipelined"]
    assert summary["vs_memory"] == pytest.approx(piped["step_ms"] / memory["step_ms"])
    for run in (memory, piped):  # every timed step kept, the median and mean theirs
        assert len(run["timed_step_ms"]) == 2
        assert run["step_ms"] == pytest.approx(statistics.median(run["timed_step_ms"]))
        assert run["mean_step_ms"] == pytest.approx(statistics.mean(run["timed_step_ms"]))
    assert len(piped["peak_rss_gib"]) == 2
    # the write log: rows appended, the ones still logged drained at the end, that drain
    # spread over the steps and added to the mean
    assert 0 < piped["logged_rows"] <= piped["appended_rows"] and piped["drain_s"] > 0
    assert piped["mean_with_drains_ms"] == pytest.approx(
        piped["mean_step_ms"] + piped["drain_ms_per_step"]
    )
    assert memory["drain_ms_per_step"] == 0 and memory["log_rows"] == 0
    assert not list((tmp_path / "tables").glob("**/*.rows"))  # each job's files are deleted


def test_the_disk_miss_cost_splits_the_tiers_cpu_over_its_threads(tmp_path: Path) -> None:
    result = _one_process(
        tmp_path,
        "disk_miss_cost.py",
        *("--disk-gb", "0.02", "--cache-gb", "0.002", "--batch", "512"),
        *("--steps", "2", "--cycles", "1", "--dir", str(tmp_path / "tables")),
    )
    assert result["timed_steps"] >= 2 and 0 < result["hit_rate"] < 1
    threads = result["threads_cpu_ms"]
    assert set(threads) == {"training", "drain", "other_live", "ended"}
    assert sum(threads.values()) == pytest.approx(result["process_cpu_ms"])
    assert result["us_per_miss"] == pytest.approx(
        result["process_cpu_ms"] * 1e3 / result["misses_per_step"]
    )
    phases = result["phases_cpu_ms"]  # the bookkeeping and the fetch inside to_slots
    assert phases["assign"] + phases["fetch"] <= phases["to_slots"] + 1e-6
    assert not list((tmp_path / "tables").glob("**/*.rows"))  # the table files are deleted
