"""Two jobs on one MASTER_PORT: a second job's ranks started on the address of a running job
are refused when they join, saying so, and the running job is not disturbed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import manualpar as mp
from manualpar.testing import run_distributed

pytestmark = pytest.mark.timeout(180)

SECOND_JOB = Path(__file__).resolve().parents[1] / "scripts" / "second_job.py"


def _first_job(directory: str) -> float:
    """Rank 0 starts the second job's ranks on this job's port once both ranks joined; rank 1
    waits for it (on a file: a collective's timeout would make the test depend on load)."""
    strategy = mp.ManualParallelStrategy()
    strategy.barrier("both joined")
    done = Path(directory) / "second_job.json"
    if strategy.rank == 0:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
        second = subprocess.run(
            [sys.executable, str(SECOND_JOB)], env=env, capture_output=True, text=True, timeout=120
        )
        (done.with_suffix(".err")).write_text(second.stderr)
        done.write_text(second.stdout)
    else:
        deadline = time.monotonic() + 150
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    total = strategy.all_reduce(1.0, op="sum").item()  # this job still works
    strategy.teardown()
    return total


def test_a_second_job_on_the_same_port_is_refused_and_the_first_goes_on(tmp_path: Path) -> None:
    totals = run_distributed(
        _first_job, world_size=2, args=(str(tmp_path),), timeout=170, collective_timeout=30
    )
    assert totals == [2.0, 2.0]
    second = json.loads((tmp_path / "second_job.json").read_text() or "{}")
    assert second, (tmp_path / "second_job.err").read_text()
    rank0, rank1 = second["0"], second["1"]
    # the second job's rank 0 cannot host the store: the first job's rank 0 does
    found = re.match(
        r"rank 0 of 2 could not join the process group at (127\.0\.0\.1:\d+) ", rank0["error"]
    )
    assert rank0["type"] == "CollectiveError" and found, rank0
    address = found.group(1)
    assert (
        f"Another process (perhaps another job) already listens on {address}; pick another "
        "MASTER_PORT for this job."
    ) in rank0["error"]
    # its rank 1 reaches the first job's store, finds rank 1 taken, and stops before joining
    assert rank1 == {
        "type": "CollectiveError",
        "error": f"rank 1 of 2: another process already joined the job at {address} as rank "
        "1: another job is probably using the same MASTER_ADDR:MASTER_PORT (pick another "
        "MASTER_PORT for this job), or two processes of this job were started with rank 1",
    }
