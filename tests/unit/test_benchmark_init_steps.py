"""bench_init.py's init-plus-steps figures and its cold gap (examples/benchmarks/init_steps.py),
on made-up job results: no process started, nothing timed."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_modules import load_example

host_memory = load_example(Path("benchmarks/host_memory.py"), "bench_host_memory")
init_steps = load_example(
    Path("benchmarks/init_steps.py"), "bench_init_steps", {"host_memory": host_memory}
)


def test_init_and_first_steps_add_up_and_the_late_step_is_the_second_halfs_median() -> None:
    run = {"init_cpu_s": 0.5, "step_cpu_ms": [1000.0, 30.0, 20.0, 10.0, 14.0, 16.0]}
    assert init_steps.totals(run) == pytest.approx(
        {"steps_cpu_s": 1.09, "init_and_steps_cpu_s": 1.59, "late_step_cpu_ms": 14.0}
    )
    run["pages_per_rank"] = [{"huge_mib": 1000.4}, {"huge_mib": None}]
    assert "6 steps CPU 1.09 s (first 1000 ms" in init_steps.steps_line(run)
    assert "[1000, 0]" in init_steps.steps_line(run)
    assert init_steps.steps_line({"init_cpu_s": 0.5}) == ""  # no --steps


def test_the_cold_gap_waits_and_says_what_the_kernel_reported_meanwhile(monkeypatch) -> None:
    reported = iter([100.0, 1400.0])
    monkeypatch.setattr(init_steps, "free_memory", lambda: {"reported_mib": next(reported)})
    slept: list[float] = []
    monkeypatch.setattr(init_steps.time, "sleep", slept.append)
    assert init_steps.wait_cold(20.0) == 1300.0
    assert slept == [20.0]
    assert init_steps.wait_cold(0.0) is None  # no gap: no wait, nothing to say
    assert init_steps.gap_note({"gap_reported_mib": 1300.0}).endswith(
        "1300 MiB reported during the gap"
    )
    assert init_steps.gap_note({}) == ""
