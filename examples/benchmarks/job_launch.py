"""One fresh torchrun job of a benchmark's worker script, and its rank 0's JSON result: the
launcher the benchmarks share (bench_init.py, embedding_jobs.py, bench_disk_tier.py).

The job runs `python -m torch.distributed.run --standalone --nproc-per-node RANKS script *args
--result FILE` with one thread per process (OMP_NUM_THREADS=1) and the repository on PYTHONPATH;
the worker writes its JSON to FILE. A job that wrote nothing raises with the end of its stderr; one
that wrote its result and then died on the way out is kept, and said.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the repository: manualpar imports from there

__all__ = ["ROOT", "job_command", "job_env", "launch"]


def job_command(
    python: str, script: str | Path, args: list[str], result: str, ranks: int = 2
) -> list[str]:
    """The torchrun command line of one job: `script *args --result result` on `ranks`."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(script),
        *args,
        "--result",
        result,
    ]


def job_env(env: dict[str, str] | None = None, pythonpath: str | Path | None = None) -> dict:
    """This process's environment, one thread per process, PYTHONPATH the repository (or
    `pythonpath`: another source tree), then `env` over it."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(pythonpath or ROOT),
        **(env or {}),
    }


def _said_exit_code(returncode: int, stderr: str) -> None:
    print(f"  (exit code {returncode} after writing its result)", flush=True)


def launch(
    python: str,
    script: str | Path,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    pythonpath: str | Path | None = None,
    ranks: int = 2,
    timeout: float | None = None,
    on_exit_code: Callable[[int, str], None] = _said_exit_code,
) -> dict:
    """Run one fresh job (see the module's docstring) and return its JSON result.
    `on_exit_code(returncode, stderr)` is told of a job that wrote its result and then failed."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = job_command(python, script, args, result, ranks)
        run = subprocess.run(
            command,
            env=job_env(env, pythonpath),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if not os.path.exists(result):
            raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
        if run.returncode:  # measured and written, then died on the way out: keep, but say so
            on_exit_code(run.returncode, run.stderr)
        return dict(json.loads(Path(result).read_text()))
