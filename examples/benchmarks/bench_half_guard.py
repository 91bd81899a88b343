"""The cost of guarding half rows against overflow in the update (step/half_overflow.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/benchmarks/bench_half_guard.py --json runs/bench_half_guard.json

The same float16 tables (RowWiseAdagrad, embedding_workload.py's uniform ids) train in the same
processes with the guard (`shard_embeddings(..., guard_half_rows=True)`) and without it (the
default), in rotating order per repeat; the median ratio of their step times and the extra
milliseconds per step are reported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

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

VARIANTS = ("unguarded", "guarded")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", choices=("table_wise", "row_wise"), default="table_wise")
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


def build(args: argparse.Namespace, strategy: mp.ManualParallelStrategy, guarded: bool) -> object:
    configs = [
        EmbeddingBagConfig(f"t{i}", args.rows, args.dim, dtype=torch.float16)
        for i in range(args.tables)
    ]
    world = strategy.world_size
    place = (lambda i: table_wise(i % world)) if args.plan == "table_wise" else lambda i: row_wise()
    plan = EmbeddingPlan(world, {c.name: place(i) for i, c in enumerate(configs)})
    with mp.empty_init():
        ebc = EmbeddingBagCollection(configs, seed=0)
    return shard_embeddings(
        ebc, strategy, plan, RowWiseAdagrad(lr=args.lr), guard_half_rows=guarded
    )


def stepper(emb: object, data: list[SparseFeatures]) -> Callable[[], None]:
    position = [0]

    def step() -> None:
        features = data[position[0] % len(data)]
        position[0] += 1
        emb(features).values.square().mean().backward()  # type: ignore[operator]

    return step


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    world = strategy.world_size
    keys = tuple(f"t{i}" for i in range(args.tables))
    lengths = torch.full((args.tables * local_batch(args, world),), args.ids_per_bag)
    data = [
        SparseFeatures(keys, batch_ids(args, strategy.rank, world, step).flatten(), lengths)
        for step in range(args.warmup + args.steps)
    ]
    steps = {v: stepper(build(args, strategy, v == "guarded"), data) for v in VARIANTS}
    repeats = []
    for repeat in range(args.repeats):
        order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
        ms = {
            v: 1000 * median(time_steps(strategy, steps[v], args.steps, args.warmup)) for v in order
        }
        repeats.append({f"{v}_ms": ms[v] for v in VARIANTS})
    summary = {
        "unguarded_ms": median([r["unguarded_ms"] for r in repeats]),
        "guarded_ms": median([r["guarded_ms"] for r in repeats]),
        "ratio": median([r["guarded_ms"] / r["unguarded_ms"] for r in repeats]),
        "extra_ms_per_step": median([r["guarded_ms"] - r["unguarded_ms"] for r in repeats]),
    }
    if strategy.is_global_zero:
        print(
            f"float16 step: {summary['unguarded_ms']:.2f} ms unguarded, "
            f"{summary['guarded_ms']:.2f} ms guarded: x{summary['ratio']:.3f} "
            f"({summary['extra_ms_per_step']:+.2f} ms)",
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
