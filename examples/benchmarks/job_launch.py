"""One fresh torchrun job of a benchmark's worker script, and its rank 0's JSON result: the
launcher the benchmarks share (bench_init.py, embedding_jobs.py, bench_disk_tier.py), and their
`--baseline-src DIR` option: a "-baseline" variant's jobs run with another source tree (say, the
commit before a change) on PYTHONPATH, interleaved with this one's (`add_baseline_src`,
`source_of`).

The job runs `python -m torch.distributed.run --standalone --nproc-per-node RANKS script *args
--result FILE` with one thread per process (OMP_NUM_THREADS=1) and the repository on PYTHONPATH;
the worker writes its JSON to FILE. A job that wrote nothing raises with the end of its stderr; one
that wrote its result and then died on the way out is kept, and said.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the repository: manualpar imports from there
BASELINE = "-baseline"  # a variant whose jobs run from --baseline-src (lru-baseline, ...)

__all__ = [
    "BASELINE",
    "ROOT",
    "add_baseline_src",
    "baseline_source",
    "baseline_variants",
    "job_command",
    "job_env",
    "launch",
    "source_of",
]


def add_baseline_src(parser: argparse.ArgumentParser, adds: str) -> None:
    """The `--baseline-src DIR` option; `adds` names the variant it adds to the rotation."""
    parser.add_argument(
        "--baseline-src",
        type=baseline_source,
        default=None,
        metavar="DIR",
        help=f"another checkout of the project (say, the commit before a change): adds {adds}, "
        "its jobs run with DIR on PYTHONPATH, in the same rotation. DIR's C++ kernels build "
        "once, in their own extensions directory (named by a hash of their sources): about "
        "40 s, minutes on a loaded host, in its first job; a tree with the same kernel sources "
        "finds the library already built",
    )


def baseline_source(path: str) -> str:
    """--baseline-src's DIR, made absolute (the JSON records where it ran from), checked to hold
    manualpar; a str, so that the arguments stay JSON."""
    directory = Path(path).resolve()
    if not (directory / "manualpar" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(
            f"{path} holds no manualpar/__init__.py: give the root of a checkout of the project "
            "(e.g. `git worktree add ../manualpar-before HEAD~1`)"
        )
    return str(directory)


def baseline_variants(
    variants: list[str],
    baseline_src: str | None,
    added: str,
    stem: Callable[[str], str] = lambda variant: variant,
) -> list[str]:
    """The variants to run: those named, a "-baseline" one (`stem(variant)` ends with it, as
    `source_of` reads it: run from `baseline_src`) only where named; where `baseline_src` is given
    and none is named, `added` appended (the variant `add_baseline_src` says it adds). One named
    without `baseline_src` would run this tree under the baseline's name: a ValueError."""
    named = [v for v in variants if stem(v).endswith(BASELINE)]
    if named and baseline_src is None:
        raise ValueError(
            f"{', '.join(named)} run from --baseline-src's tree: give --baseline-src DIR (a "
            "checkout of the commit to compare against), or name the variants without "
            f"{BASELINE}"
        )
    if baseline_src is None or named:
        return list(variants)
    return [*variants, added]


def source_of(variant: str, baseline_src: str | Path | None) -> Path:
    """The source tree a variant's jobs import manualpar from: `baseline_src` for a "-baseline"
    variant (where one is given), this repository otherwise."""
    if variant.endswith(BASELINE) and baseline_src is not None:
        return Path(baseline_src)
    return ROOT


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
