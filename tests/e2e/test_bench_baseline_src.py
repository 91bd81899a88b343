"""bench_embeddings.py --baseline-src DIR: manualpar's worker importing another source tree's
manualpar, interleaved with this tree's, at toy size (numbers are not asserted: timing has no
place in tests). The other tree is a copy of this one: its kernel sources hash the same, so it
finds the library this tree's jobs built and builds nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from example_modules import EXAMPLES
from launch import run_python

import manualpar

BENCH = EXAMPLES / "benchmarks" / "bench_embeddings.py"
TOY = ("--rows", "500", "--tables", "2", "--dim", "8", "--batch", "64", "--steps", "2")
# a pair's ratios, current over baseline: wall-clock step, CPU time per step, peak RSS, init
RATIOS = {"ms_per_step", "cpu_ms_per_step", "peak_rss", "init_s", "init_cpu_s", "pairs"}


@pytest.mark.timeout(120)
def test_baseline_src_reports_current_over_the_other_tree(tmp_path: Path) -> None:
    before = tmp_path / "before"
    package = Path(manualpar.__file__).resolve().parent
    shutil.copytree(package, before / "manualpar", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "result.json"
    run_python(
        BENCH,
        *TOY,
        *("--warmup", "1", "--repeats", "1", "--plans", "table_wise", "--skip-baseline"),
        *("--baseline-src", str(before), "--json", str(out)),
        timeout=100,
        check=True,
    )
    result = json.loads(out.read_text())
    assert result["args"]["baseline_src"] == str(before.resolve())
    (ours,) = result["runs"]["table_wise"]["manualpar"]
    (theirs,) = result["runs"]["table_wise"]["manualpar-baseline"]
    # each job imported manualpar from its own tree
    assert ours["source"] == str(package.parent) and theirs["source"] == str(before.resolve())
    ratio = result["summary"]["table_wise"]["manualpar/manualpar-baseline"]
    assert set(ratio) == RATIOS and ratio["pairs"] == 1
    assert all(ratio[key] > 0 for key in RATIOS)
    assert ratio["ms_per_step"] == pytest.approx(ours["ms_per_step"] / theirs["ms_per_step"])
    assert ratio["cpu_ms_per_step"] == pytest.approx(
        ours["cpu_ms_per_step"] / theirs["cpu_ms_per_step"]
    )


def test_baseline_src_must_hold_manualpar(tmp_path: Path) -> None:
    """A DIR that is not a checkout of the project is refused before any job starts."""
    run = run_python(BENCH, *TOY, "--baseline-src", str(tmp_path), timeout=60)
    assert run.returncode == 2 and "holds no manualpar/__init__.py" in run.stderr
