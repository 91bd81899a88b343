"""Command line: `python -m manualpar inspect CKPT | plot RUN_DIR | launch ... | plan ... |
calibrate`.

Each command is a module with `add_arguments(parser)` and `run(args) -> int`; this module only
builds the parser and turns manualpar's own errors into one-line messages (exit code 2).
"""

from __future__ import annotations

import argparse
import sys

from manualpar import ManualParError
from manualpar.cli import calibrate, inspect, launch, plan, plot

__all__ = ["main"]

COMMANDS = {
    "inspect": (inspect, "keys, shapes, sharding and step of a checkpoint"),
    "plot": (plot, "metrics.jsonl of a Trainer run -> PNG"),
    "launch": (launch, "run a script on N local processes (torchrun)"),
    "plan": (plan, "an embedding sharding plan for tables on N ranks"),
    "calibrate": (calibrate, "measure this host for the planner (writes a topology file)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m manualpar", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (command, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except ManualParError as error:  # a clear one-line message, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
