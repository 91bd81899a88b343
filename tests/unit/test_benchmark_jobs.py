"""The benchmarks' shared job launcher (examples/benchmarks/job_launch.py, no process started
here: its subprocess.run is replaced) and the host memory figures bench_init.py records
(host_memory.py, on sample kernel files).

Running the benchmarks at toy size is in tests/e2e/test_benchmarks.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from example_modules import EXAMPLES, load_example

launcher = load_example(Path("benchmarks/job_launch.py"), "bench_job_launch")
host_memory = load_example(Path("benchmarks/host_memory.py"), "bench_host_memory")


def _fake_run(monkeypatch: Any, returncode: int, result: dict | None) -> list[dict]:
    calls: list[dict] = []

    def run(command: list[str], **kwargs: Any) -> Any:
        calls.append({"command": command, **kwargs})
        if result is not None:
            Path(command[command.index("--result") + 1]).write_text(json.dumps(result))
        return launcher.subprocess.CompletedProcess(command, returncode, "", "rank 1: boom")

    monkeypatch.setattr(launcher.subprocess, "run", run)
    return calls


def test_a_job_runs_its_script_under_torchrun_and_returns_rank_zeros_json(monkeypatch) -> None:
    calls = _fake_run(monkeypatch, 0, {"seconds": 1.5})
    got = launcher.launch("py", "worker.py", ["--worker", "x"], env={"A": "1"}, timeout=9)
    assert got == {"seconds": 1.5}
    (call,) = calls
    command = call["command"]
    torchrun = ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert command[:9] == [*torchrun, "worker.py", "--worker", "x"] and command[9] == "--result"
    assert call["env"]["OMP_NUM_THREADS"] == "1" and call["env"]["A"] == "1"
    assert call["env"]["PYTHONPATH"] == str(EXAMPLES.parent) and call["timeout"] == 9
    launcher.launch("py", "w.py", [], pythonpath="/other/tree", ranks=3)
    assert calls[1]["env"]["PYTHONPATH"] == "/other/tree"
    assert calls[1]["command"][5] == "3"


def test_a_job_that_died_after_its_result_is_kept_and_said(monkeypatch) -> None:
    _fake_run(monkeypatch, 1, {"ok": True})
    told: list[tuple[int, str]] = []
    got = launcher.launch("py", "w.py", [], on_exit_code=lambda code, err: told.append((code, err)))
    assert got == {"ok": True} and told == [(1, "rank 1: boom")]


def test_a_job_without_a_result_raises_with_its_stderr(monkeypatch) -> None:
    _fake_run(monkeypatch, 1, None)
    with pytest.raises(RuntimeError, match="failed:\nrank 1: boom"):
        launcher.launch("py", "w.py", [])


def test_the_baseline_variants_run_as_named() -> None:
    def variants(*named: str, src: str | None = "/before") -> list[str]:  # as bench_disk_tier's
        stem = lambda v: v.partition("-log")[0]  # noqa: E731
        return launcher.baseline_variants(list(named), src, "lru-baseline", stem=stem)

    # lrfu against the baseline's lrfu: no lru-baseline added
    assert variants("memory", "lrfu", "lrfu-baseline") == ["memory", "lrfu", "lrfu-baseline"]
    assert variants("lru", "lru-baseline-log11") == ["lru", "lru-baseline-log11"]
    assert variants("memory", "lru-baseline", "lru") == ["memory", "lru-baseline", "lru"]
    # none named: the baseline's LRU added, as before; no --baseline-src: as named
    assert variants("memory", "lrfu", "lru") == ["memory", "lrfu", "lru", "lru-baseline"]
    assert variants("memory", "lrfu", src=None) == ["memory", "lrfu"]
    with pytest.raises(ValueError, match="lrfu-baseline run from --baseline-src's tree"):
        variants("lrfu", "lrfu-baseline", src=None)  # would run this tree under that name


def test_free_memory_splits_the_free_blocks_at_the_reporting_order(monkeypatch, tmp_path) -> None:
    (tmp_path / "buddyinfo").write_text(
        "Node 0, zone      DMA      0      0      0      0      0      0      0      0      1"
        "      1      3\n"
        "Node 0, zone   Normal    256      0      0      0      0      0      0      0      0"
        "      2      1\n"
    )
    (tmp_path / "page_reporting_order").write_text("9\n")
    monkeypatch.setattr(host_memory, "BUDDYINFO", tmp_path / "buddyinfo")
    monkeypatch.setattr(host_memory, "REPORTING", tmp_path)
    free = host_memory.free_memory()
    # below order 9: 256 pages of 4 KiB and one 1 MiB block; at 9 and 10: 3 x 2 MiB + 4 x 4 MiB
    assert free["free_below_order_mib"] == 2.0
    assert free["free_at_order_mib"] == 22.0
    assert free["reporting_order"] == 9 and free["reported_mib"] is None
    monkeypatch.setattr(host_memory, "BUDDYINFO", tmp_path / "absent")
    assert host_memory.free_memory()["free_below_order_mib"] is None
