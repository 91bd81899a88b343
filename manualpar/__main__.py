"""Command line: `python -m manualpar inspect CKPT | plot RUN_DIR | launch ... | plan ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main"]


def _inspect(args: argparse.Namespace) -> int:
    from manualpar.inspect_checkpoint import describe_checkpoint, format_description

    info = describe_checkpoint(args.checkpoint)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from manualpar.plot import plot_metrics

    print(plot_metrics(args.run_dir, args.out))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from manualpar.plan_command import run

    return run(args)


def _launch(args: argparse.Namespace) -> int:
    """Replace this process with torchrun on local processes (one node)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        "--max-restarts",
        str(args.max_restarts),
        args.script,
        *args.script_args,
    ]
    os.execv(sys.executable, command)
    return 0  # pragma: no cover - execv does not return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m manualpar", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="keys, shapes, sharding and step of a checkpoint")
    inspect.add_argument("checkpoint")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(run=_inspect)
    plot = commands.add_parser("plot", help="metrics.jsonl of a Trainer run -> PNG")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    plot.set_defaults(run=_plot)
    launch = commands.add_parser("launch", help="run a script on N local processes (torchrun)")
    launch.add_argument("--nproc", type=int, default=2)
    launch.add_argument("--max-restarts", type=int, default=0)
    launch.add_argument("script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)
    launch.set_defaults(run=_launch)
    plan = commands.add_parser("plan", help="an embedding sharding plan for tables on N ranks")
    from manualpar.plan_command import add_arguments

    add_arguments(plan)
    plan.set_defaults(run=_plan)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except Exception as error:  # a clear one-line message, not a traceback, for user errors
        from manualpar.errors import ManualParError

        if isinstance(error, ManualParError):
            print(f"error: {error}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
