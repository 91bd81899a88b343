"""The sizes riding with the ids (step/ids_exchange.py) against the sizes sent apart.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_ids_exchange.py --tables 26 --rows 200000 --dim 16 \\
        --ids-per-bag 1 --blocks 48 --json runs/bench_ids_exchange.json

One collection (embedding_workload.py's tables, uniform ids, RowWiseAdagrad, table-wise) trains
in the same processes in alternating blocks of `--per-block` steps with the sizes folded into
the ids exchange (`folded`, the default) and sent apart (`separate`: IdsExchange.enabled False),
in ABBA order, so a loaded host's swings fall on both alike. The step after each switch is not
timed (it decides how the next one exchanges). Per step: the slowest rank's wall clock, and the
busiest rank's thread and process CPU time (process: gloo's threads too); the summary gives each
variant's median and the ratio folded / separate. Where a rank's payloads exceed FOLD_MAX both
variants send the sizes apart, and the ratio measures the spread of the measurement.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from bench_common import environment_info, median, write_json
from embedding_workload import batch_features

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    shard_embeddings,
    table_wise,
)

CLOCKS = ("wall", "thread", "process")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2048, help="global batch (all ranks)")
    parser.add_argument("--ids-per-bag", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=48, help="ABBA blocks, half each variant")
    parser.add_argument("--per-block", type=int, default=5, help="timed steps a block")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    # embedding_workload.batch_features' fixed-length uniform ids
    args.plan, args.lengths, args.ids, args.sequence, args.dtype = (
        "table_wise",
        "fixed",
        "uniform",
        False,
        "fp32",
    )
    return args


def main() -> None:
    args = parse_args()
    strategy = mp.ManualParallelStrategy()
    world, rank = strategy.world_size, strategy.rank
    configs = [
        EmbeddingBagConfig(f"t{i}", args.rows, args.dim, feature_names=(f"f{i}",))
        for i in range(args.tables)
    ]
    plan = EmbeddingPlan(
        world, {c.name: table_wise(i * world // args.tables) for i, c in enumerate(configs)}
    )
    with mp.empty_init():
        ebc = EmbeddingBagCollection(configs, seed=0)
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.01, eps=1e-8))
    keys = tuple(f"f{i}" for i in range(args.tables))
    batches = [batch_features(args, rank, world, step) for step in range(16)]
    exchange = emb.step.forward_phases.ids_exchange

    def step(index: int) -> None:
        ids, lengths = batches[index % len(batches)]
        emb(SparseFeatures(keys, ids, lengths)).values.square().mean().backward()

    for index in range(args.warmup):
        step(index)
    times: dict[bool, list[list[float]]] = {True: [], False: []}
    index = args.warmup
    for block in range(args.blocks):
        folded = block % 4 in (0, 3)  # ABBA
        exchange.enabled = folded
        step(index)  # the switch's own step: how the next one exchanges is decided here
        index += 1
        for _ in range(args.per_block):
            strategy.barrier()
            wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            step(index)
            index += 1
            spent = torch.tensor(
                [
                    time.perf_counter() - wall,
                    time.thread_time() - thread,
                    time.process_time() - process,
                ],
                dtype=torch.float64,
            )
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)  # the slowest rank's, the busiest's
            times[folded].append([1000 * value for value in spent.tolist()])
    summary = {}
    for i, clock in enumerate(CLOCKS):
        folded_ms = median([t[i] for t in times[True]])
        separate_ms = median([t[i] for t in times[False]])
        summary[clock] = {"folded_ms": folded_ms, "separate_ms": separate_ms}
        summary[clock]["ratio"] = folded_ms / separate_ms
    if strategy.is_global_zero:
        for clock, row in summary.items():
            print(
                f"{clock}: folded {row['folded_ms']:.3f} ms, separate {row['separate_ms']:.3f} "
                f"ms, folded / separate {row['ratio']:.3f}",
                flush=True,
            )
        write_json(
            args.json, {"args": vars(args), **summary, "environment": environment_info(strategy)}
        )
    strategy.teardown()


if __name__ == "__main__":
    main()
