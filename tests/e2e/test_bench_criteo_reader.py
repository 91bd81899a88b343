"""The Criteo reader benchmark runs end to end at toy size and writes consistent JSON (numbers
are not asserted: timing has no place in tests)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from example_modules import EXAMPLES
from launch import run_python


def test_reader_benchmark_writes_rates_and_read_costs(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run_python(
        EXAMPLES / "benchmarks" / "bench_criteo_reader.py",
        *("--lines", "3000", "--data-dir", str(tmp_path / "data"), "--batch", "256"),
        *("--max-rows", "2000", "--steps", "2", "--warmup", "1", "--repeats", "2"),
        *("--json", str(out)),
        timeout=120,
        check=True,
    )
    assert (tmp_path / "data/day.tsv").stat().st_size > 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {  # 1 process: no 1/world variants
        "train",
        "read plain, all lines",
        "read gzip, all lines",
        "train, reading inline",
        "train, read ahead",
    }
    train = results["train"]["median"]
    for name, result in results.items():
        assert len(result["samples_per_s"]) == 2
        assert result["median"] == statistics.median(result["samples_per_s"])
        if name.startswith("read "):
            assert result["read_cost_per_step"] == pytest.approx(train / result["median"])
        elif name != "train":
            assert result["step_time_vs_pre_read"] == pytest.approx(train / result["median"])
