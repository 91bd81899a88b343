"""2-D (replicate, shard) sharded tables against 1-D over the same ranks: step time and bytes.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \
        examples/benchmarks/bench_tables_2d.py --json runs/bench_tables_2d.json

Both variants train the same tables (RowWiseAdagrad) on the same batches (rank r's ids from
embedding_workload.batch_ids) in the same processes: "1d" shards every table over all ranks,
"2d" over the shard dim of `strategy.mesh(replicate=R, shard=S)` (default S = processes per
node, or --shard) and replicates over the other. Repeats alternate 1d and 2d; the ratio 2d / 1d
of the median step times is reported per repeat and overall (median of the ratios).

Bytes sent per step per rank are counted from the all_to_all splits of each exchange (ids,
pooled output, output gradient, and for 2d the replica combine of row gradients), so they do
not depend on the host; "cross-node" counts what goes to ranks of another node, with nodes of
--ranks-per-node ranks (default: the launcher's processes per node; give 2 on one machine to
see what a 2-node job would send across).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import cycling_step, environment_info, median, time_steps, write_json
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

Counts = dict[str, dict[str, int]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", choices=("table_wise", "row_wise"), default="table_wise")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1024, help="global batch (all ranks)")
    parser.add_argument("--ids-per-bag", type=int, default=10)
    parser.add_argument(
        "--hot-rows",
        type=int,
        default=None,
        help="draw ids from the first N rows only (skewed ids: fewer distinct rows per step)",
    )
    parser.add_argument("--shard", type=int, default=None, help="shard dim (default: per node)")
    parser.add_argument("--ranks-per-node", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--json")
    return parser.parse_args()


def make_plan(args: argparse.Namespace, configs: list[EmbeddingBagConfig], ranks: int) -> Any:
    place = (
        (lambda i: table_wise(i % ranks)) if args.plan == "table_wise" else (lambda i: row_wise())
    )
    return EmbeddingPlan(ranks, {c.name: place(i) for i, c in enumerate(configs)})


def ids(args: argparse.Namespace, rank: int, world: int, step: int) -> torch.Tensor:
    drawn = batch_ids(args, rank, world, step)
    return drawn % args.hot_rows if args.hot_rows else drawn


def count_bytes(strategy: mp.ManualParallelStrategy, per_node: int) -> tuple[Counts, Callable]:
    """Wrap the strategy's all_to_all_async to add up, per exchange name, the bytes this rank
    sends to others and the part of them that leaves its node. Returns (counts, undo)."""
    counts: Counts = defaultdict(lambda: {"sent": 0, "cross_node": 0})
    original = strategy.all_to_all_async
    me = strategy.rank

    def counting(tensor: torch.Tensor, send: list[int], receive: list[int], **kw: Any) -> Any:
        group = kw.get("group")
        members = (
            list(range(strategy.world_size)) if group is None else group.mesh.flatten().tolist()
        )
        name = kw.get("name", "all_to_all").split(": ", 1)[-1]
        for dest, count in zip(members, send, strict=True):
            if dest != me:
                size = count * tensor.element_size()
                counts[name]["sent"] += size
                counts[name]["cross_node"] += size if dest // per_node != me // per_node else 0
        return original(tensor, send, receive, **kw)

    vars(strategy)["all_to_all_async"] = counting  # shadows the method until undo() deletes it

    def undo() -> None:
        del strategy.all_to_all_async

    return counts, undo


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    world = strategy.world_size
    per_node = args.ranks_per_node or strategy.environment.local_world_size
    shard = args.shard or min(per_node, world)
    mesh = strategy.mesh(replicate=world // shard, shard=shard)
    configs = [
        EmbeddingBagConfig(f"t{i}", args.rows, args.dim, feature_names=(f"f{i}",))
        for i in range(args.tables)
    ]
    keys = tuple(f"f{i}" for i in range(args.tables))
    batch = local_batch(args, world)
    lengths = torch.full((args.tables * batch,), args.ids_per_bag, dtype=torch.int64)
    batches = [
        SparseFeatures(keys, ids(args, strategy.rank, world, step).flatten(), lengths)
        for step in range(args.warmup + args.steps)
    ]
    variants = {}
    for name, plan_ranks, variant_mesh in (("1d", world, None), ("2d", shard, mesh)):
        with mp.empty_init():
            ebc = EmbeddingBagCollection(configs, seed=0)
        variants[name] = shard_embeddings(
            ebc,
            strategy,
            make_plan(args, configs, plan_ranks),
            RowWiseAdagrad(lr=args.lr),
            mesh=variant_mesh,
        )

    steps = {name: cycling_step(emb, batches) for name, emb in variants.items()}
    bytes_per_rank: dict[str, list[Counts]] = {}
    for name, step in steps.items():
        step()  # warm
        counts, undo = count_bytes(strategy, per_node)
        step()
        undo()
        bytes_per_rank[name] = strategy.all_gather_object(dict(counts))
    repeats = []
    for _ in range(args.repeats):
        medians = {
            name: median(time_steps(strategy, step, args.steps, args.warmup))
            for name, step in steps.items()
        }
        repeats.append({**{f"{n}_ms": 1000 * t for n, t in medians.items()}})
        repeats[-1]["ratio_2d_over_1d"] = medians["2d"] / medians["1d"]
    summary: dict[str, dict[str, Any]] = {
        name: {
            "sent_per_rank": max(sum(c["sent"] for c in r.values()) for r in ranks),
            "cross_node_per_rank": max(sum(c["cross_node"] for c in r.values()) for r in ranks),
            "by_exchange_rank0": ranks[0],
        }
        for name, ranks in bytes_per_rank.items()
    }
    result: dict[str, Any] = {
        "args": vars(args),
        "mesh": {"replicate": world // shard, "shard": shard, "ranks_per_node": per_node},
        "repeats": repeats,
        "ratio_2d_over_1d": median([r["ratio_2d_over_1d"] for r in repeats]),
        "ms_per_step": {name: median([r[f"{name}_ms"] for r in repeats]) for name in ("1d", "2d")},
        "bytes_per_step": summary,
        "environment": environment_info(strategy),
    }
    if strategy.is_global_zero:
        for name, data in summary.items():
            print(
                f"{name}: {result['ms_per_step'][name]:.1f} ms/step, sent "
                f"{data['sent_per_rank'] / 2**20:.2f} MiB/rank/step, cross-node "
                f"{data['cross_node_per_rank'] / 2**20:.2f} MiB; by exchange (rank 0): "
                + ", ".join(
                    f"{k}: {v['sent'] / 2**20:.2f}/{v['cross_node'] / 2**20:.2f}"
                    for k, v in data["by_exchange_rank0"].items()
                )
            )
        print(f"2d / 1d step time: {result['ratio_2d_over_1d']:.2f}x")
        write_json(args.json, result)
    strategy.teardown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
