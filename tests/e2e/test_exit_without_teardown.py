"""A torchrun job whose script never calls strategy.teardown() still exits cleanly.

Without teardown, the gloo group used to outlive the script into interpreter finalization. A gloo
worker thread that had not yet dropped its last finished collective then asked for the GIL,
was ended by pthread_exit inside a noexcept destructor, and the rank died with "terminate called
without an active exception" (SIGABRT) after training had succeeded. The abort itself is rare (a
loaded machine), so besides the clean exit the script reports, from an exit handler of its own,
that manualpar destroyed the group before finalization.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from launch import output_tail, run_torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "exit_without_teardown.py"
ENV = {"MANUALPAR_TIMEOUT_S": "20", "OMP_NUM_THREADS": "1"}
ABORTED = ("terminate called", "SIGABRT", "Signal 6", "exitcode  : -6")


def _launch(*args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    result = run_torchrun(SCRIPT, *args, nproc=2, env=ENV, timeout=90)
    return result, (result.stdout or "") + (result.stderr or "")


def _assert_no_abort(result: subprocess.CompletedProcess[str], output: str) -> None:
    aborted = [marker for marker in ABORTED if marker in output]
    assert not aborted, f"a rank aborted at exit ({aborted})\n{output_tail(result)}"


def _assert_group_destroyed_at_exit(
    result: subprocess.CompletedProcess[str], ranks: int = 2
) -> None:
    """At least `ranks` ranks reported, from their own exit handler, that the group was gone."""
    reports = re.findall(r"at exit: process group destroyed=(True|False)", result.stdout or "")
    assert len(reports) >= ranks and set(reports) == {"True"}, (
        f"manualpar must destroy the group before finalization\n{output_tail(result)}"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("parts", ["both", "ddp", "fsdp"])
def test_script_without_teardown_exits_cleanly(parts: str) -> None:
    result, output = _launch("--parts", parts)
    _assert_no_abort(result, output)
    assert result.returncode == 0, output_tail(result)
    # The two ranks' lines may interleave on torchrun's stdout: match values, not whole lines.
    trained = re.findall(r"rank (\d) trained: loss (-?\d+\.\d{4})", result.stdout or "")
    assert sorted(rank for rank, _ in trained) == ["0", "1"], output_tail(result)
    assert len({loss for _, loss in trained}) == 1, output_tail(result)  # the all-reduced mean
    _assert_group_destroyed_at_exit(result)


@pytest.mark.timeout(120)
def test_script_that_raises_reports_its_own_error() -> None:
    result, output = _launch("--raise-after")
    _assert_no_abort(result, output)
    assert result.returncode != 0, output_tail(result)
    assert "RuntimeError: injected failure after training on rank" in output, output_tail(result)
    assert re.search(r"exitcode\s*:\s*1\b", output), output_tail(result)
    _assert_group_destroyed_at_exit(result, ranks=1)  # torchrun may stop the second rank first
