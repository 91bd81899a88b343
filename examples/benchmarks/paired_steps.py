"""Two variants of one sharded-table step, timed in the same processes: the shared half of
bench_half_guard.py and bench_pipeline.py (bench_step_times.py takes its arguments and tables).

The tables are embedding_workload.py's (uniform ids, row-wise Adagrad); each repeat times the
variants one after the other, in alternating order, and the summary gives each variant's median
milliseconds per step and the median of the repeats' ratios (candidate / base).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

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
    UpdateRule,
    row_wise,
    shard_embeddings,
    table_wise,
)


def parse_args(description: str, plan: str, steps: int = 10) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--plan", choices=("table_wise", "row_wise"), default=plan)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="global batch (all ranks)")
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--json")
    return parser.parse_args()


def build_tables(
    args: argparse.Namespace,
    strategy: mp.ManualParallelStrategy,
    dtype: torch.dtype = torch.float32,
    rule: UpdateRule | None = None,
    **options: Any,
) -> Any:
    """`--tables` tables placed by `--plan`, sharded with `options` (shard_embeddings') and
    `rule` (default RowWiseAdagrad at `--lr`)."""
    configs = [
        EmbeddingBagConfig(f"t{i}", args.rows, args.dim, dtype=dtype) for i in range(args.tables)
    ]
    world = strategy.world_size
    place = (lambda i: table_wise(i % world)) if args.plan == "table_wise" else lambda i: row_wise()
    plan = EmbeddingPlan(world, {c.name: place(i) for i, c in enumerate(configs)})
    with mp.empty_init():
        ebc = EmbeddingBagCollection(configs, seed=0)
    return shard_embeddings(ebc, strategy, plan, rule or RowWiseAdagrad(lr=args.lr), **options)


def workload(args: argparse.Namespace, strategy: mp.ManualParallelStrategy, count: int) -> list:
    """This rank's first `count` batches of the workload."""
    world = strategy.world_size
    keys = tuple(f"t{i}" for i in range(args.tables))
    lengths = torch.full((args.tables * local_batch(args, world),), args.ids_per_bag)
    return [
        SparseFeatures(keys, batch_ids(args, strategy.rank, world, step).flatten(), lengths)
        for step in range(count)
    ]


def compare(
    args: argparse.Namespace,
    strategy: mp.ManualParallelStrategy,
    steps: dict[str, Callable[[], None]],
) -> dict[str, float]:
    """Time the two variants of `steps` (base first), print and write the summary."""
    base, candidate = steps
    repeats = []
    for repeat in range(args.repeats):
        order = [base, candidate] if repeat % 2 == 0 else [candidate, base]
        ms = {
            v: 1000 * median(time_steps(strategy, steps[v], args.steps, args.warmup)) for v in order
        }
        repeats.append({f"{v}_ms": ms[v] for v in steps})
    summary = {
        f"{base}_ms": median([r[f"{base}_ms"] for r in repeats]),
        f"{candidate}_ms": median([r[f"{candidate}_ms"] for r in repeats]),
        "ratio": median([r[f"{candidate}_ms"] / r[f"{base}_ms"] for r in repeats]),
        "extra_ms_per_step": median([r[f"{candidate}_ms"] - r[f"{base}_ms"] for r in repeats]),
    }
    if strategy.is_global_zero:
        print(
            f"{args.plan}: {summary[f'{base}_ms']:.2f} ms {base}, "
            f"{summary[f'{candidate}_ms']:.2f} ms {candidate}: x{summary['ratio']:.3f} "
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
    return summary
