"""`python -m manualpar launch --nproc N script.py ...`: torchrun on local processes, one node."""

from __future__ import annotations

import argparse
import os
import sys

from manualpar.cli.plan import UsageError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    """Replace this process with torchrun (so signals and the exit code are torchrun's)."""
    # checked here: torchrun would answer a bare AssertionError from deep inside its agent
    if args.nproc < 1:
        raise UsageError(f"launch --nproc {args.nproc}: expected processes per node, at least 1")
    if args.max_restarts < 0:
        raise UsageError(f"launch --max-restarts {args.max_restarts}: expected 0 or more")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(args.nproc), "--max-restarts", str(args.max_restarts),
        args.script, *args.script_args,
    ]  # fmt: skip
    os.execv(sys.executable, command)
    return 0  # pragma: no cover - execv does not return
