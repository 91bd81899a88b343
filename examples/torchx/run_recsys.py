"""The recommender example through torchx on 2 local processes, with one injected failure.

    python examples/torchx/run_recsys.py --out runs/torchx-recsys

Builds the job with manualpar's torchx component (the AppDef that `torchx run -s local_cwd
manualpar.run_script ...` builds) and runs it with torchx's Runner on the local_cwd scheduler.
Rank 1 raises once at --fail-at (examples/recsys/train.py --fail-once-at-step); torchrun's one
allowed restart starts both ranks again, the Trainer resumes from the last checkpoint, and the
job finishes. The same AppDef goes to slurm or kubernetes with another scheduler name.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from torchx.runner import get_runner
from torchx.schedulers.api import Stream
from torchx.specs import AppDef, AppState, AppStatus

from manualpar.cli.torchx_component import run_script

TRAIN = Path(__file__).resolve().parent.parent / "recsys" / "train.py"
SMALL = (
    "--max-rows",
    "20000",
    "--batch",
    "512",
    "--val-samples",
    "2048",
    "--log-every",
    "10",
    "--no-progress",
)


def recsys_app(
    out: str | Path,
    *,
    steps: int = 60,
    fail_at: int | None = 25,
    checkpoint_every: int = 10,
    max_restarts: int = 1,
    nproc: int = 2,
    train_args: Sequence[str] = SMALL,
    env: dict[str, str] | None = None,
) -> AppDef:
    """train.py under torchrun on `nproc` local processes; rank 1 fails once at `fail_at`."""
    args = [
        "--out",
        str(Path(out).resolve()),
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(checkpoint_every),
        "--val-every",
        str(steps),
        *train_args,
    ]
    if fail_at is not None:
        args += ["--fail-once-at-step", str(fail_at)]
    return run_script(
        *args, script=str(TRAIN), j=f"1x{nproc}", max_restarts=max_restarts, name="recsys", env=env
    )


def run(app: AppDef, log_dir: str | Path) -> tuple[AppStatus, list[str]]:
    """Run `app` on local_cwd and wait; returns its final status and the job's output lines
    (torchrun's replica 0 holds every local rank's output)."""
    with get_runner() as runner:
        handle = runner.run(app, scheduler="local_cwd", cfg={"log_dir": str(log_dir)})
        status = runner.wait(handle, wait_interval=0.5)
        lines = [
            line.rstrip("\n")
            for line in runner.log_lines(handle, "worker", 0, streams=Stream.COMBINED)
        ]
    assert status is not None, f"torchx lost the job {handle}"
    return status, lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/torchx-recsys", help="train.py's run directory")
    parser.add_argument("--log-dir", default="runs/torchx-logs", help="torchx's log_dir")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fail-at", type=int, default=25, help="rank 1 fails once at this step")
    parser.add_argument("--max-restarts", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    app = recsys_app(
        args.out,
        steps=args.steps,
        fail_at=args.fail_at,
        max_restarts=args.max_restarts,
        nproc=args.nproc,
    )
    status, lines = run(app, args.log_dir)
    print("\n".join(lines))
    print(f"torchx: {status.state}, logs under {args.log_dir}")
    return 0 if status.state == AppState.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
