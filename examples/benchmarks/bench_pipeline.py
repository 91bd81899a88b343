"""The pipelined step against the plain one: TrainPipeline sends batch i + 1's ids during step i.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_pipeline.py --json runs/bench_pipeline.json

The same tables (RowWiseAdagrad, embedding_workload.py's uniform ids, batches built beforehand)
train in the same processes in a plain loop and through `TrainPipeline`, in alternating order
per repeat (paired_steps.py); a step is `next(batches)`, the forward and the backward, so the
pipeline's own cost (its agreement, the prefetch) is inside it.
"""

from __future__ import annotations

import torch
from bench_common import endless, pipelined_step, stepper
from paired_steps import build_tables, compare, parse_args, workload

import manualpar as mp


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], plan="row_wise")
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    pool = workload(args, strategy, 8)
    plain, piped = build_tables(args, strategy), build_tables(args, strategy)
    steps = {
        "plain": stepper(plain, endless(pool)),
        "pipelined": pipelined_step(piped, pool, strategy),
    }
    compare(args, strategy, steps)
    strategy.teardown()


if __name__ == "__main__":
    main()
