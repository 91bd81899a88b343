"""One process, one table: the fused row-wise Adagrad update against a lookup of the same ids.

    python examples/benchmarks/bench_embedding_kernels.py --rows 1000000 16000000 \
        --dtypes fp32 bf16 --json runs/bench_embedding_kernels.json

For each table size and row dtype (rows x 64, on huge pages as shard_embeddings allocates them),
each repetition draws fresh uniform ids (40,960 per call: 2048 bags of 20) and times, back to
back, in this process's CPU time (a shared host's other jobs do not count):
- lookup: `pooled_sum` (fp32: `F.embedding_bag`, FBGEMM's kernel inside ATen; bf16/fp16: the
  C++ half-row kernel, summing in float32), a read of every row;
- group: the radix-sort grouping the sharded step does in forward;
- update: the fused row-wise Adagrad pass (read and write every distinct row and its state;
  half rows rounded back, bfloat16 stochastically).
The update is reported as a ratio to the lookup of the same run, so the memory system's cost
of writing rows, and how it grows with the table, shows apart from the machine's speed of the
hour. Needs the C++ kernels (a compiler); no communication, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from embedding_workload import add_kernel_args, run_per_table_size

from manualpar.embeddings.kernels.bags import ShardBags, group_rows, pooled_sum
from manualpar.embeddings.kernels.native import native_kernels
from manualpar.embeddings.kernels.row_memory import empty_rows, zeros_rows

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fused_update(
    weight: torch.Tensor, state: torch.Tensor, bags: ShardBags, grads: torch.Tensor, key: int
) -> None:
    """The fused row-wise Adagrad kernel the step runs (optim/fused_rowwise.py), every row."""
    kernels = native_kernels()
    assert kernels is not None and bags.groups is not None
    g = bags.groups
    common: tuple[object, ...] = (weight, state, None, g.order, g.starts, g.bags, g.rows, g.runs)
    common += (0, g.runs.numel())
    common += ([grads], [1.0], 0, bags.lengths.numel(), 0, 0.01, 1e-8)
    if weight.dtype == torch.float32:
        kernels.rowwise_adagrad_update(*common)
    else:  # bfloat16 stochastically, float16 to nearest, as the step rounds them
        stochastic = weight.dtype == torch.bfloat16
        kernels.rowwise_adagrad_update_rounded(*common, stochastic, key, 0, weight.shape[1], None)


def measure_dtype(rows: int, args: argparse.Namespace, name: str) -> dict:
    dtype = DTYPES[name]
    generator = torch.Generator().manual_seed(rows)
    weight = empty_rows(rows, args.dim, dtype=dtype)
    weight.copy_(torch.empty(rows, args.dim).uniform_(-0.01, 0.01, generator=generator))
    state = zeros_rows(rows)
    lengths = torch.full((args.bags,), args.ids_per_bag)
    grads = torch.randn(args.bags, args.dim, generator=generator)
    times: dict[str, list[float]] = {"lookup_ms": [], "group_ms": [], "update_ms": []}
    for repeat in range(args.warmup + args.repeats):
        ids = torch.randint(0, rows, (args.bags * args.ids_per_bag,), generator=generator)
        started = time.process_time()
        pooled_sum(weight, ids, lengths, None)
        looked_up = time.process_time()
        bags = ShardBags(ids, lengths, None, 0, args.bags)
        bags.groups = group_rows(bags, rows)
        grouped = time.process_time()
        fused_update(weight, state, bags, grads, key=repeat)
        updated = time.process_time()
        if repeat >= args.warmup:
            times["lookup_ms"].append(1000 * (looked_up - started))
            times["group_ms"].append(1000 * (grouped - looked_up))
            times["update_ms"].append(1000 * (updated - grouped))
    medians = {key: statistics.median(values) for key, values in times.items()}
    ratios = [u / lk for u, lk in zip(times["update_ms"], times["lookup_ms"], strict=True)]
    return {
        **medians,
        "table_gib": rows * args.dim * weight.element_size() / 2**30,
        "update_vs_lookup": statistics.median(ratios),
        "samples": times,
    }


def measure(rows: int, args: argparse.Namespace) -> dict:
    """Each dtype's times under "dtypes"; the first dtype's also at the top level."""
    by_dtype = {name: measure_dtype(rows, args, name) for name in args.dtypes}
    return {"rows": rows, **by_dtype[args.dtypes[0]], "dtypes": by_dtype}


def describe(result: dict) -> str:
    return "".join(
        f"\n  {name} ({r['table_gib']:.2f} GiB): lookup {r['lookup_ms']:.3f} ms, "
        f"group {r['group_ms']:.3f} ms, update {r['update_ms']:.3f} ms; "
        f"update / lookup {r['update_vs_lookup']:.2f}x"
        for name, r in result["dtypes"].items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_kernel_args(parser)
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["fp32"])
    args = parser.parse_args()
    if native_kernels() is None:
        raise SystemExit("the C++ kernels could not be built here; this benchmark times them")
    run_per_table_size(args, measure, describe)


if __name__ == "__main__":
    main()
