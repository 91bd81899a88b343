"""A script launched through torchx in the tests: reports its ranks, can fail once or always."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

import manualpar as mp


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail", choices=["never", "first_attempt", "always"], default="never")
    args = parser.parse_args()
    strategy = mp.ManualParallelStrategy()
    restart = strategy.environment.restart_count
    if strategy.rank == 1 and (
        args.fail == "always" or (args.fail == "first_attempt" and restart == 0)
    ):
        raise RuntimeError(f"injected failure on rank 1, attempt {restart}")
    total = strategy.all_reduce(float(strategy.rank + 1), op="sum").item()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = {
        "rank": strategy.rank,
        "world_size": strategy.world_size,
        "sum": total,
        "restart_count": restart,
        "source": strategy.environment.source,
        "pid": os.getpid(),
    }
    (Path(args.out) / f"rank_{strategy.rank}.json").write_text(json.dumps(report))
    strategy.teardown()


if __name__ == "__main__":
    main()
