"""bench_embeddings.py's jobs: each measurement a fresh torchrun job of RANKS processes
(`launch`), the variants a run compares (`variants`: manualpar, the plain-torch baseline, the
peer, manualpar's optional steps and manualpar from --baseline-src), and what a failed job
leaves (its error lines, its whole stderr beside the JSON). The modes (embedding_compare.py,
embedding_scale.py, embedding_precision.py) run them."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import job_launch

from manualpar import malloc_env

HERE = Path(__file__).resolve().parent
WORKER = HERE / "bench_embeddings.py"  # its --worker runs one variant under torchrun
RANKS = 2  # processes per job (torchrun --nproc-per-node)

__all__ = ["RANKS", "error_lines", "keep_stderr", "launch", "variants"]
_said_allocator = False


# --- orchestration -----------------------------------------------------------------------------
def launch(
    python: str,
    script: Path,
    extra: list[str],
    args: argparse.Namespace,
    plan: str,
    rows: int,
    pythonpath: str | Path | None = None,
) -> dict:
    """One job of a variant on `plan` with tables of `rows`; `pythonpath`: the source tree its
    manualpar imports from (job_launch.source_of; this repository by default)."""
    workload = [
        "--plan",
        plan,
        "--tables",
        str(args.tables),
        "--rows",
        str(rows),
        "--dim",
        str(args.dim),
        "--batch",
        str(args.batch),
        "--ids-per-bag",
        str(args.ids_per_bag),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--lr",
        str(args.lr),
        "--lengths",
        args.lengths,
        *(["--sequence"] if args.sequence else []),
        "--ids",
        getattr(args, "ids", "uniform"),
        "--zipf-exponent",
        str(getattr(args, "zipf_exponent", 1.05)),
    ]
    # glibc's thresholds as manualpar's strategy fixes them in its own processes, for both
    # peers' jobs from their start: left to glibc's dynamic threshold, the peer's step swung
    # by up to 1.5x with what its process freed before (docs/benchmarks.md)
    allocator = malloc_env(os.environ)
    global _said_allocator
    if not _said_allocator:
        _said_allocator = True
        said = " ".join(f"{k}={v}" for k, v in allocator.items()) or "glibc's default"
        print(f"allocator, every job of both peers: {said}", flush=True)

    def died_after_result(returncode: int, stderr: str) -> None:
        kept = keep_stderr(stderr, args)
        print(
            f"  (exit code {returncode} after writing its result; its errors:)\n"
            + "\n".join(f"    {line[:160]}" for line in error_lines(stderr))
            + (f"\n    (whole stderr with the ranks' stacks: {kept})" if kept else ""),
            flush=True,
        )

    result = job_launch.launch(
        python,
        script,
        [*extra, *workload],
        # faulthandler: a rank that dies on a signal prints every thread's Python stack
        env={**allocator, "PYTHONFAULTHANDLER": "1"},
        pythonpath=pythonpath,
        ranks=RANKS,
        timeout=900,
        on_exit_code=died_after_result,
    )
    return {**result, "allocator": allocator or "default"}


def keep_stderr(stderr: str, args: argparse.Namespace) -> Path | None:
    """A dying job's whole stderr beside the --json output (None without --json): the rare
    aborts at exit are not reproduced alone, so each one's stacks are worth keeping."""
    if not getattr(args, "json", None):
        return None
    folder = Path(args.json).parent
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{Path(args.json).stem}.failed-{time.strftime('%Y%m%d-%H%M%S')}.log"
    path.write_text(stderr)
    return path


def error_lines(stderr: str, keep: int = 6) -> list[str]:
    """The lines of a failed job's stderr that say what failed (not torchrun's banners)."""
    marks = ("Error", "error", "Signal", "signal", "Traceback", "terminate", "Exception")
    lines = [line for line in stderr.splitlines() if any(m in line for m in marks)]
    return lines[-keep:] or stderr.strip().splitlines()[-keep:]


def variants(args: argparse.Namespace) -> dict[str, tuple[str, Path, list[str]]]:
    found = {
        "manualpar": (sys.executable, WORKER, ["--worker", "manualpar"]),
        "baseline": (sys.executable, WORKER, ["--worker", "baseline"]),
    }
    if args.peer_python:
        found["torchrec"] = (args.peer_python, HERE / "peer_torchrec.py", [])
    if args.skip_baseline or args.sequence or args.lengths != "fixed":  # it pools fixed bags
        del found["baseline"]
    if args.sequence and not args.skip_padded:  # the sequence exchange as it was: padded
        found["padded"] = (sys.executable, WORKER, ["--worker", "manualpar", "--padded"])
    if args.pipelined:
        found["pipelined"] = (
            sys.executable,
            WORKER,
            ["--worker", "manualpar", "--pipelined"],
        )
    if args.floor:
        found["local"] = (sys.executable, WORKER, ["--worker", "local"])
    if args.batch_tables:
        found["batched"] = (
            sys.executable,
            WORKER,
            ["--worker", "manualpar", "--batch-tables"],
        )
    if getattr(args, "baseline_src", None):  # this worker, manualpar imported from there
        if args.scale or args.precision:
            raise SystemExit("--baseline-src runs in the default mode (no --scale, --precision)")
        found["manualpar" + job_launch.BASELINE] = (
            sys.executable,
            WORKER,
            ["--worker", "manualpar"],
        )
    return found
