"""The pipelined step against the plain one: TrainPipeline sends batch i + 1's ids during step i.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_pipeline.py --json runs/bench_pipeline.json

The same tables (RowWiseAdagrad, embedding_workload.py's uniform ids, batches built beforehand)
train in the same processes in a plain loop and through `TrainPipeline`, in alternating order
per repeat (paired_steps.py); a step is `next(batches)`, the forward and the backward, so the
pipeline's own cost (its agreement, the prefetch) is inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from paired_steps import build_tables, compare, parse_args, workload

import manualpar as mp
from manualpar.embeddings import SparseFeatures


def endless(pool: list[SparseFeatures]) -> Iterator[SparseFeatures]:
    """The pool's batches round and round, a new object each time (a prefetched batch is
    matched by identity)."""
    index = 0
    while True:
        batch = pool[index % len(pool)]
        yield SparseFeatures(batch.keys, batch.values, batch.lengths)
        index += 1


def stepper(emb: Any, batches: Iterator[SparseFeatures]) -> Callable[[], None]:
    def step() -> None:
        emb(next(batches)).values.square().mean().backward()

    return step


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], plan="row_wise")
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    pool = workload(args, strategy, 8)
    plain, piped = build_tables(args, strategy), build_tables(args, strategy)
    pipeline = iter(mp.TrainPipeline(endless(pool), strategy, piped.prefetch))
    steps = {"plain": stepper(plain, endless(pool)), "pipelined": stepper(piped, pipeline)}
    compare(args, strategy, steps)
    strategy.teardown()


if __name__ == "__main__":
    main()
