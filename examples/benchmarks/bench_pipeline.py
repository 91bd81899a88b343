"""The pipelined step against the plain one: TrainPipeline sends batch i + 1's ids during step i.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_pipeline.py --json runs/bench_pipeline.json

The same tables (RowWiseAdagrad, embedding_workload.py's uniform ids, batches built beforehand)
train in the same processes in a plain loop and through `TrainPipeline`, in alternating order
per repeat; a step is `next(batches)`, the forward and the backward, so the pipeline's own cost
(its agreement, the prefetch) is inside it. The median ratio and the milliseconds per step are
reported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import torch
from bench_common import environment_info, median, time_steps, write_json
from embedding_workload import batch_ids, local_batch

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)

VARIANTS = ("plain", "pipelined")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", choices=("table_wise", "row_wise"), default="row_wise")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="global batch (all ranks)")
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--json")
    return parser.parse_args()


def build(args: argparse.Namespace, strategy: mp.ManualParallelStrategy) -> torch.nn.Module:
    configs = [EmbeddingBagConfig(f"t{i}", args.rows, args.dim) for i in range(args.tables)]
    world = strategy.world_size
    place = (lambda i: table_wise(i % world)) if args.plan == "table_wise" else lambda i: row_wise()
    plan = EmbeddingPlan(world, {c.name: place(i) for i, c in enumerate(configs)})
    with mp.empty_init():
        ebc = EmbeddingBagCollection(configs, seed=0)
    return shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=args.lr))


def stepper(emb: torch.nn.Module, batches: Iterator[SparseFeatures]) -> Callable[[], None]:
    def step() -> None:
        features = next(batches)
        emb(features).values.square().mean().backward()

    return step


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    world = strategy.world_size
    keys = tuple(f"t{i}" for i in range(args.tables))
    lengths = torch.full((args.tables * local_batch(args, world),), args.ids_per_bag)
    pool = [
        SparseFeatures(keys, batch_ids(args, strategy.rank, world, step).flatten(), lengths)
        for step in range(8)
    ]

    def endless() -> Iterator[SparseFeatures]:
        index = 0
        while True:  # a new object each step: a prefetched batch is matched by identity
            yield SparseFeatures(pool[index % 8].keys, pool[index % 8].values, lengths)
            index += 1

    emb = {v: build(args, strategy) for v in VARIANTS}
    loops: dict[str, Iterator[SparseFeatures]] = {
        "plain": endless(),
        "pipelined": iter(mp.TrainPipeline(endless(), strategy, emb["pipelined"].prefetch)),
    }
    steps = {v: stepper(emb[v], loops[v]) for v in VARIANTS}
    repeats = []
    for repeat in range(args.repeats):
        order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
        ms = {
            v: 1000 * median(time_steps(strategy, steps[v], args.steps, args.warmup)) for v in order
        }
        repeats.append({f"{v}_ms": ms[v] for v in VARIANTS})
    summary = {
        "plain_ms": median([r["plain_ms"] for r in repeats]),
        "pipelined_ms": median([r["pipelined_ms"] for r in repeats]),
        "ratio": median([r["pipelined_ms"] / r["plain_ms"] for r in repeats]),
    }
    if strategy.is_global_zero:
        print(
            f"{args.plan}: {summary['plain_ms']:.2f} ms plain, {summary['pipelined_ms']:.2f} ms "
            f"pipelined: x{summary['ratio']:.3f}",
            flush=True,
        )
        write_json(
            args.json,
            {
                "args": vars(args),
                "repeats": repeats,
                **summary,
                "environment": environment_info(strategy),
            },
        )
    strategy.teardown()


if __name__ == "__main__":
    main()
