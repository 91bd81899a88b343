"""A second job's ranks started on the MASTER_ADDR:MASTER_PORT of a job already running: try to
join as rank 0 and as rank 1 of 2, and print what each attempt raised as JSON."""

from __future__ import annotations

import json
import os
import sys

import manualpar as mp


def join(rank: int) -> dict[str, str]:
    environment = mp.ClusterEnvironment(
        rank=rank,
        world_size=2,
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        source="user",
    )
    try:
        strategy = mp.ManualParallelStrategy(environment, accelerator="cpu", timeout=60)
    except Exception as error:
        return {"type": type(error).__name__, "error": str(error)}
    strategy.teardown(wait_for_peers=False)
    return {"type": "joined", "error": ""}


if __name__ == "__main__":
    json.dump({str(rank): join(rank) for rank in (0, 1)}, sys.stdout)
