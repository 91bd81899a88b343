"""Where a rank's step goes, phase by phase, under each plan of the same tables in one job.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_plan_phases.py --ids zipf --json runs/bench_plan_phases.json

Both ranks build every plan of --plans over bench_embeddings.py's tables (8 x 1M x 64 fp32, 20
ids a bag, global batch 2048, fused row-wise Adagrad) and train them on the same batches, plans
in alternating order per repeat. Each measured step records its phases (`emb.phase_times`:
ids exchange, lookup, pooled exchange, gradient exchange, update) with one clock, alternating
step by step: the wall clock, or the rank's own thread time (`time.thread_time`: the phase's
own work, not its waits, nor another process's turn on a loaded host); "other" is the rest of
the step (autograd, the loss, the Python around the phases). The report gives each rank's
median milliseconds per phase, plan and clock.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from bench_common import write_json
from embedding_workload import add_id_args, batch_features, predraw

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
from manualpar.phase_times import (
    GRAD_EXCHANGE,
    IDS_EXCHANGE,
    LOOKUP,
    POOLED_EXCHANGE,
    UPDATE,
    PhaseTimes,
)

PLANS = ("table_wise", "row_wise")
PHASES = (IDS_EXCHANGE, LOOKUP, POOLED_EXCHANGE, GRAD_EXCHANGE, UPDATE, "other", "step")
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--plans", nargs="+", choices=PLANS, default=list(PLANS))
    add("--tables", type=int, default=8)
    add("--rows", type=int, default=1_000_000)
    add("--dim", type=int, default=64)
    add("--batch", type=int, default=2048, help="global batch (all ranks)")
    add("--ids-per-bag", type=int, default=20)
    add("--steps", type=int, default=30, help="measured steps a plan and repeat")
    add("--warmup", type=int, default=5)
    add("--repeats", type=int, default=3)
    add("--json", default=None)
    add_id_args(parser)
    args = parser.parse_args()
    args.lengths = "fixed"
    return args


def build(args: argparse.Namespace, strategy: mp.ManualParallelStrategy, plan: str) -> Any:
    world = strategy.world_size
    tables = [
        EmbeddingBagConfig(f"t{i}", args.rows, args.dim, feature_names=(f"f{i}",))
        for i in range(args.tables)
    ]
    placement = {
        t.name: table_wise(i * world // args.tables) if plan == "table_wise" else row_wise()
        for i, t in enumerate(tables)
    }
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables)
    return shard_embeddings(
        ebc, strategy, EmbeddingPlan(world, placement), RowWiseAdagrad(lr=0.01, eps=1e-8)
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    world, rank = strategy.world_size, strategy.rank
    count = args.warmup + args.steps
    predraw(args, rank, world, count)
    keys = tuple(f"f{i}" for i in range(args.tables))
    data = [SparseFeatures(keys, *batch_features(args, rank, world, i)) for i in range(count)]
    built = {plan: build(args, strategy, plan) for plan in args.plans}
    recorders = {name: PhaseTimes(clock=clock) for name, clock in CLOCKS.items()}
    rows: dict[str, dict[str, list[dict[str, float]]]] = {
        plan: {name: [] for name in CLOCKS} for plan in args.plans
    }
    for repeat in range(args.repeats):
        for plan in args.plans if repeat % 2 == 0 else args.plans[::-1]:
            emb = built[plan]
            for index in range(count):
                name = ("wall", "thread")[index % 2]
                clock, recorder = CLOCKS[name], recorders[name]
                emb.phase_times = recorder
                strategy.barrier()
                recorder.start()
                started = clock()
                emb(data[index]).values.square().mean().backward()
                step = clock() - started
                phases = recorder.stop()
                if index >= args.warmup:
                    phases["other"] = step - sum(phases.values())
                    phases["step"] = step
                    rows[plan][name].append(phases)
    medians = {
        plan: {
            name: {p: 1000 * statistics.median(r.get(p, 0.0) for r in steps) for p in PHASES}
            for name, steps in by_clock.items()
        }
        for plan, by_clock in rows.items()
    }
    every = strategy.all_gather_object(medians)
    if rank == 0:
        for r, ranked in enumerate(every):
            for plan, by_clock in ranked.items():
                for name, ms in by_clock.items():
                    cells = " ".join(f"{p} {v:.2f}" for p, v in ms.items())
                    print(f"rank {r} {plan:10s} {name:6s} ms: {cells}", flush=True)
        if args.json:
            write_json(args.json, {"args": vars(args), "ms_per_step": every})
    strategy.teardown()


if __name__ == "__main__":
    main()
