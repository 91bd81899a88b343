"""One process, one table: the fused row-wise Adagrad update against a lookup of the same ids.

    python examples/benchmarks/bench_embedding_kernels.py --rows 1000000 16000000 \
        --json runs/bench_embedding_kernels.json

For each table size (rows x 64 fp32, on huge pages as shard_embeddings allocates them), each
repetition draws fresh uniform ids (40,960 per call: 2048 bags of 20) and times, back to back:
- lookup: `F.embedding_bag` (FBGEMM's kernel inside ATen), a read of every row;
- group: the radix-sort grouping the sharded step does in forward;
- update: the fused row-wise Adagrad pass (read and write every distinct row and its state).
The update is reported as a ratio to the lookup of the same run, so the memory system's cost
of writing rows, and how it grows with the table, shows apart from the machine's speed of the
hour. Needs the C++ kernels (a compiler); no communication, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from embedding_workload import add_kernel_args, run_per_table_size

from manualpar.embeddings import RowWiseAdagrad
from manualpar.embeddings.kernels.bags import (
    BagGradients,
    RowPass,
    ShardBags,
    bag_offsets,
    group_rows,
)
from manualpar.embeddings.kernels.native import native_kernels
from manualpar.embeddings.kernels.row_memory import empty_rows, zeros_rows


def measure(rows: int, args: argparse.Namespace) -> dict:
    generator = torch.Generator().manual_seed(rows)
    weight = empty_rows(rows, args.dim)
    weight.uniform_(-0.01, 0.01, generator=generator)
    state = {"sum": zeros_rows(rows)}
    rule = RowWiseAdagrad(lr=0.01, eps=1e-8)
    lengths = torch.full((args.bags,), args.ids_per_bag)
    offsets = bag_offsets(lengths)
    grads = torch.randn(args.bags, args.dim, generator=generator)
    times: dict[str, list[float]] = {"lookup_ms": [], "group_ms": [], "update_ms": []}
    for repeat in range(args.warmup + args.repeats):
        ids = torch.randint(0, rows, (args.bags * args.ids_per_bag,), generator=generator)
        started = time.perf_counter()
        F.embedding_bag(ids, weight, offsets, mode="sum")
        looked_up = time.perf_counter()
        bags = ShardBags(ids, lengths, None, 0, args.bags)
        bags.groups = group_rows(bags, rows)
        grouped = time.perf_counter()
        rule.step_bags(weight, state, bags, BagGradients([grads], [1.0]), 0, 1, RowPass.ALL)
        updated = time.perf_counter()
        if repeat >= args.warmup:
            times["lookup_ms"].append(1000 * (looked_up - started))
            times["group_ms"].append(1000 * (grouped - looked_up))
            times["update_ms"].append(1000 * (updated - grouped))
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = [u / lk for u, lk in zip(times["update_ms"], times["lookup_ms"], strict=True)]
    return {
        "rows": rows,
        "table_gib": rows * args.dim * 4 / 2**30,
        **medians,
        "update_vs_lookup": statistics.median(ratios),
        "samples": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_kernel_args(parser)
    args = parser.parse_args()
    if native_kernels() is None:
        raise SystemExit("the C++ kernels could not be built here; this benchmark times them")
    run_per_table_size(
        args,
        measure,
        lambda r: (
            f" ({r['table_gib']:.2f} GiB): lookup {r['lookup_ms']:.2f} ms, "
            f"group {r['group_ms']:.2f} ms, update {r['update_ms']:.2f} ms; "
            f"update / lookup {r['update_vs_lookup']:.2f}x"
        ),
    )


if __name__ == "__main__":
    main()
