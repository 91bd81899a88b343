"""The torchx component, launched for real through torchx's Runner on local processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchx.runner import get_runner
from torchx.specs import AppState

from manualpar.cli.torchx_component import run_script

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "launched.py")
# torchx's local scheduler starts torchrun, and torchrun its workers, warm (conftest.py)
pytestmark = pytest.mark.usefixtures("warm_launcher")


def _launch(tmp_path: Path, *script_args: str, max_restarts: int = 0):  # type: ignore[no-untyped-def]
    app = run_script(
        *script_args,
        script=SCRIPT,
        j="1x2",
        max_restarts=max_restarts,
        env={"MANUALPAR_TIMEOUT_S": "20"},
    )
    with get_runner() as runner:
        handle = runner.run(app, scheduler="local_cwd", cfg={"log_dir": str(tmp_path / "logs")})
        return runner.wait(handle, wait_interval=0.2)


def _reports(directory: Path) -> list[dict]:
    return [json.loads((directory / f"rank_{r}.json").read_text()) for r in range(2)]


def test_local_launch_runs_two_ranks(tmp_path: Path) -> None:
    status = _launch(tmp_path, "--out", str(tmp_path / "out"))
    assert status.state == AppState.SUCCEEDED, status
    reports = _reports(tmp_path / "out")
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["sum"] == 3.0 and r["source"] == "torchelastic" for r in reports)


def test_worker_error_reaches_torchx_status(tmp_path: Path) -> None:
    status = _launch(tmp_path, "--out", str(tmp_path / "out"), "--fail", "always")
    assert status.state == AppState.FAILED
    assert "injected failure on rank 1, attempt 0" in str(status)


def test_restart_recovers_from_a_failed_attempt(tmp_path: Path) -> None:
    status = _launch(
        tmp_path, "--out", str(tmp_path / "out"), "--fail", "first_attempt", max_restarts=1
    )
    assert status.state == AppState.SUCCEEDED, status
    assert [r["restart_count"] for r in _reports(tmp_path / "out")] == [1, 1]
