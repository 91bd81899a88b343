"""The torch.compile benchmark runs end to end at toy size on 2 ranks (aot_eager: no C++ build),
so it does not rot between the runs that produce docs' numbers; times are not asserted."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from example_modules import EXAMPLES
from launch import run_torchrun

BENCH = EXAMPLES / "benchmarks" / "bench_compile.py"


@pytest.mark.timeout(240)
def test_compile_benchmark_reports_ratios_of_its_own_medians(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    toy = ["--max-rows", "500", "--batch", "64", "--steps", "2", "--warmup", "1", "--repeats", "2"]
    run_torchrun(BENCH, *toy, "--backend", "aot_eager", "--json", str(out), timeout=220, check=True)
    result = json.loads(out.read_text())
    assert result["environment"]["world_size"] == 2
    for name in ("step", "dense"):
        run = result["results"][name]
        assert len(run["eager_ms"]) == len(run["compiled_ms"]) == 2
        ratios = [c / e for c, e in zip(run["compiled_ms"], run["eager_ms"], strict=True)]
        assert run["ratios"] == pytest.approx(ratios, rel=1e-9)
        assert run["median_ratio"] == statistics.median(run["ratios"])
    assert len(result["compile_s"]["cached"]) == 1
