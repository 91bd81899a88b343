"""The cost of raw ids: HashIds and ManagedCollisions tables against tables fed rows directly.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/benchmarks/bench_raw_ids.py --json runs/bench_raw_ids.json

Four variants train the same tables (RowWiseAdagrad, the workload of embedding_workload.py:
rank r's ids of step s drawn uniformly) in the same processes: "rows" gets ids already in
[0, rows); "hash" gets raw ids (the same draws over an id space --id-space times larger,
spread over int64) and hashes them; "managed" gets those raw ids and remaps them
(ManagedCollisions, --policy, --bucket-rows) with the C++ kernels; "managed-torch" the same
on the torch path (the GPU's), for the kernels' gain. With --pipelined, "rows-pipelined" and
"managed-pipelined" train through TrainPipeline (the next batch's ids, or its raw ids to their
remappers, sent during the step). Repeats cycle through the variants in rotating order; each
variant's median step time is divided by the "rows" one of the same repeat, and the median
ratio and the extra milliseconds per step are reported ("managed-pipelined" also against
"rows-pipelined").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_common import (
    cycling_step,
    environment_info,
    median,
    pipelined_step,
    time_steps,
    write_json,
)
from embedding_workload import batch_ids, local_batch

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    HashIds,
    ManagedCollisions,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)

VARIANTS = ("rows", "hash", "managed", "managed-torch")
PIPELINED = ("rows-pipelined", "managed-pipelined")
SPREAD = 0x5851F42D4C957F2D  # an odd multiplier: raw ids spread over int64 (wrapping)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", choices=("table_wise", "row_wise"), default="table_wise")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1024, help="global batch (all ranks)")
    parser.add_argument("--ids-per-bag", type=int, default=10)
    parser.add_argument("--id-space", type=int, default=4, help="raw ids: this many x rows")
    parser.add_argument("--policy", choices=("lru", "lfu"), default="lru")
    parser.add_argument("--bucket-rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--pipelined", action="store_true", help="also rows and managed through TrainPipeline"
    )
    parser.add_argument("--json")
    return parser.parse_args()


def make_variant(
    args: argparse.Namespace, strategy: mp.ManualParallelStrategy, variant: str
) -> ShardedEmbeddingBagCollection:
    variant = variant.removesuffix("-pipelined")
    raw_ids = {
        "rows": None,
        "hash": HashIds(),
        "managed": ManagedCollisions(policy=args.policy, bucket_rows=args.bucket_rows),
        "managed-torch": ManagedCollisions(policy=args.policy, bucket_rows=args.bucket_rows),
    }[variant]
    configs = [
        EmbeddingBagConfig(f"t{i}", args.rows, args.dim, raw_ids=raw_ids)
        for i in range(args.tables)
    ]
    world = strategy.world_size
    place = (lambda i: table_wise(i % world)) if args.plan == "table_wise" else lambda i: row_wise()
    plan = EmbeddingPlan(world, {c.name: place(i) for i, c in enumerate(configs)})
    with mp.empty_init():
        ebc = EmbeddingBagCollection(configs, seed=0)
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=args.lr))
    if variant == "managed-torch":  # the torch path (the GPU's) instead of the C++ kernels
        remapper = emb.raw_id_remap
        assert remapper is not None
        for name in remapper.tables:
            remapper.table(name).native = False
    return emb


def batches(
    args: argparse.Namespace, strategy: mp.ManualParallelStrategy, raw: bool
) -> list[SparseFeatures]:
    world = strategy.world_size
    space = argparse.Namespace(**{**vars(args), "rows": args.rows * args.id_space})
    keys = tuple(f"t{i}" for i in range(args.tables))
    lengths = torch.full((args.tables * local_batch(args, world),), args.ids_per_bag)
    out = []
    for step in range(args.warmup + args.steps):
        drawn = batch_ids(space, strategy.rank, world, step).flatten()
        out.append(SparseFeatures(keys, drawn * SPREAD if raw else drawn % args.rows, lengths))
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    raw, rows = batches(args, strategy, raw=True), batches(args, strategy, raw=False)
    variants = VARIANTS + PIPELINED if args.pipelined else VARIANTS
    modules = {v: make_variant(args, strategy, v) for v in variants}
    data = {v: rows if v.startswith("rows") else raw for v in variants}
    steps = {
        v: pipelined_step(modules[v], data[v], strategy)
        if v in PIPELINED
        else cycling_step(modules[v], data[v])
        for v in variants
    }
    repeats = []
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        order = variants[shift:] + variants[:shift]
        ms = {
            v: 1000 * median(time_steps(strategy, steps[v], args.steps, args.warmup)) for v in order
        }
        repeats.append({f"{v}_ms": ms[v] for v in variants})
    summary = {
        v: {
            "ms_per_step": median([r[f"{v}_ms"] for r in repeats]),
            "ratio_to_rows": median([r[f"{v}_ms"] / r["rows_ms"] for r in repeats]),
            "extra_ms_per_step": median([r[f"{v}_ms"] - r["rows_ms"] for r in repeats]),
        }
        for v in variants
    }
    if args.pipelined:  # each pipelined step against the pipelined rows step
        summary["managed-pipelined"]["ratio_to_rows_pipelined"] = median(
            [r["managed-pipelined_ms"] / r["rows-pipelined_ms"] for r in repeats]
        )
    remap = modules["managed"].raw_id_remap
    stats = remap.raw_id_stats() if remap is not None else {}
    counts = {k: sum(s[k] for s in stats.values()) for k in ("ids", "collisions", "evictions")}
    totals = strategy.all_reduce(torch.tensor(list(counts.values()), dtype=torch.float64), "sum")
    ids, collisions, evictions = totals.tolist()
    result = {
        "args": vars(args),
        "repeats": repeats,
        "variants": summary,
        "managed_collision_rate": collisions / ids if ids else 0.0,
        "managed_eviction_rate": evictions / ids if ids else 0.0,
        "environment": environment_info(strategy),
    }
    if strategy.is_global_zero:
        for v, row in summary.items():
            print(
                f"{v:8s} {row['ms_per_step']:8.2f} ms/step  x{row['ratio_to_rows']:.3f} of rows "
                f"({row['extra_ms_per_step']:+.2f} ms)",
                flush=True,
            )
        if args.pipelined:
            ratio = summary["managed-pipelined"]["ratio_to_rows_pipelined"]
            print(f"managed-pipelined x{ratio:.3f} of rows-pipelined", flush=True)
        print(
            f"managed: collision rate {result['managed_collision_rate']:.1%}, eviction rate "
            f"{result['managed_eviction_rate']:.1%} (per distinct id per step, all steps)"
        )
        write_json(args.json, result)
    strategy.teardown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
