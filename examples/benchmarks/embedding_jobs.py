"""bench_embeddings.py's jobs: each measurement a fresh torchrun job of RANKS processes
(`launch`), the variants a run compares (`variants`: manualpar, the plain-torch baseline, the
peer and manualpar's optional steps), and what a failed job leaves (its error lines, its whole
stderr beside the JSON). The modes (embedding_compare.py, embedding_scale.py,
embedding_precision.py) run them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from manualpar import malloc_env

HERE = Path(__file__).resolve().parent
WORKER = HERE / "bench_embeddings.py"  # its --worker runs one variant under torchrun
RANKS = 2  # processes per job (torchrun --nproc-per-node)

__all__ = ["RANKS", "error_lines", "keep_stderr", "launch", "variants"]
_said_allocator = False


# --- orchestration -----------------------------------------------------------------------------
def launch(
    python: str, script: Path, extra: list[str], args: argparse.Namespace, plan: str, rows: int
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(RANKS),
            str(script),
            *extra,
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
            "--result",
            result,
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
        # faulthandler: a rank that dies on a signal prints every thread's Python stack
        env = {
            **os.environ,
            **allocator,
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": str(HERE.parent.parent),
        }
        global _said_allocator
        if not _said_allocator:
            _said_allocator = True
            said = " ".join(f"{k}={v}" for k, v in allocator.items()) or "glibc's default"
            print(f"allocator, every job of both peers: {said}", flush=True)
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if not os.path.exists(result):
            raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
        if run.returncode:  # measured and written, then died on the way out: keep, but say so
            kept = keep_stderr(run.stderr, args)
            print(
                f"  (exit code {run.returncode} after writing its result; its errors:)\n"
                + "\n".join(f"    {line[:160]}" for line in error_lines(run.stderr))
                + (f"\n    (whole stderr with the ranks' stacks: {kept})" if kept else ""),
                flush=True,
            )
        return {**json.loads(Path(result).read_text()), "allocator": allocator or "default"}


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
    return found
