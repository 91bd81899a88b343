"""The cost of guarding half rows against overflow in the update (step/half_overflow.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_half_guard.py --json runs/bench_half_guard.json

The same float16 tables (RowWiseAdagrad, embedding_workload.py's uniform ids) train in the same
processes with the guard (`shard_embeddings(..., guard_half_rows=True)`) and without it (the
default), in alternating order per repeat (paired_steps.py); the median ratio of their step
times and the extra milliseconds per step are reported.
"""

from __future__ import annotations

import torch
from bench_common import cycling_step
from paired_steps import build_tables, compare, parse_args, workload

import manualpar as mp


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], plan="table_wise")
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    data = workload(args, strategy, args.warmup + args.steps)
    steps = {
        variant: cycling_step(
            build_tables(args, strategy, torch.float16, guard_half_rows=variant == "guarded"),
            data,
        )
        for variant in ("unguarded", "guarded")
    }
    compare(args, strategy, steps)
    strategy.teardown()


if __name__ == "__main__":
    main()
