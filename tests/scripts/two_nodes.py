"""A multi-node test job: runs the cases of tests/support/node_cases.py named by --cases.

    python -m torch.distributed.run ... two_nodes.py --cases ranks,ddp --out OUT [--dir DIR]

Each rank writes its report of each case to OUT/<case>/rank_<r>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import node_compositions  # noqa: F401  (registers the composition cases)
from node_cases import CASES

import manualpar as mp


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help=f"comma-separated, of {sorted(CASES)}")
    parser.add_argument("--out", required=True, help="each case's reports go to OUT/<case>/")
    parser.add_argument("--dir", default=None, help="a folder cases share across jobs")
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; the cases are {sorted(CASES)}")
    strategy = mp.ManualParallelStrategy()
    for name in names:
        report = CASES[name](strategy, args)
        folder = Path(args.out, name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank_{strategy.rank}.json").write_text(json.dumps(report))
    strategy.teardown()


if __name__ == "__main__":
    main()
