"""The embedding benchmark's report of a failed job: the error lines, not torchrun's banners.

Running the benchmarks at toy size is in tests/e2e/test_benchmarks.py.
"""

from __future__ import annotations

import sys

from example_modules import EXAMPLES

BENCHMARKS = EXAMPLES / "benchmarks"


def test_a_failed_job_reports_its_error_lines_not_torchrun_banners() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from embedding_jobs import error_lines
    finally:
        sys.path.remove(str(BENCHMARKS))
    stderr = "\n".join(
        [
            "W1123 torch/distributed/run.py] *****************************************",
            "Traceback (most recent call last):",
            '  File "worker.py", line 3, in <module>',
            "RuntimeError: Connection closed by peer [127.0.0.1]:29500",
            "============================================================",
            "Root Cause (first observed failure):",
        ]
    )
    assert error_lines(stderr) == [
        "Traceback (most recent call last):",
        "RuntimeError: Connection closed by peer [127.0.0.1]:29500",
    ]
    assert error_lines("killed\n=====") == ["killed", "====="]


def test_a_job_dying_after_its_result_keeps_its_whole_stderr_beside_the_json(tmp_path) -> None:
    import argparse

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from embedding_jobs import keep_stderr
    finally:
        sys.path.remove(str(BENCHMARKS))
    stderr = "Fatal Python error: Aborted\n\nThread 0x00007f (most recent call first):\n  ..."
    kept = keep_stderr(stderr, argparse.Namespace(json=str(tmp_path / "out" / "bench.json")))
    assert kept is not None and kept.parent == tmp_path / "out"
    assert kept.name.startswith("bench.failed-") and kept.read_text() == stderr
    assert keep_stderr(stderr, argparse.Namespace(json=None)) is None
