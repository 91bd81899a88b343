"""The embedding benchmark's workload and measurement protocol, shared by every variant.

Plain torch only (no manualpar import): the TorchRec peer runs this module from its own virtual
environment. Every variant sees the same ids: batch `step` of rank `rank` is drawn from a
generator seeded by (rank, step), so variants differ only in how they look the ids up.

A worker writes one JSON result (see `write_result`) that bench_embeddings.py collects.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# --lengths: every bag --ids-per-bag ids, or a length drawn uniformly from 0 .. 2 x that (same mean)
LENGTHS = ("fixed", "uniform")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", choices=("table_wise", "row_wise"), default="table_wise")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="global batch (all ranks)")
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--dtype", choices=tuple(DTYPE_BYTES), default="fp32", help="how the tables store rows"
    )
    parser.add_argument("--result", required=True, help="JSON file rank 0 writes")
    parser.add_argument(
        "--sequence",
        action="store_true",
        help="unpooled tables (EmbeddingCollection): a sample's ids are a sequence, one row each",
    )
    parser.add_argument(
        "--lengths",
        choices=LENGTHS,
        default="fixed",
        help="ids per bag: exactly --ids-per-bag, or uniform over 0 .. 2 x --ids-per-bag",
    )


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    """The one-table kernel benchmarks' arguments (manualpar's and FBGEMM's peer share them)."""
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 4_000_000, 16_000_000])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--bags", type=int, default=2048)
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json")


def run_per_table_size(
    args: argparse.Namespace,
    measure: Callable[[int, argparse.Namespace], dict],
    describe: Callable[[dict], str],
) -> list[dict]:
    """The kernel benchmarks' loop: one thread, `measure(rows, args)` per table size, a line
    each (`describe(result)`), and the results as JSON to `--json` if given."""
    torch.set_num_threads(1)
    results = []
    for rows in args.rows:
        result = measure(rows, args)
        results.append(result)
        print(
            f"{rows:>11,} rows{describe(result)} per {args.bags * args.ids_per_bag:,} ids",
            flush=True,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
        print(f"wrote {args.json}")
    return results


def local_batch(args: argparse.Namespace, world_size: int) -> int:
    return args.batch // world_size


def batch_ids(args: argparse.Namespace, rank: int, world_size: int, step: int) -> torch.Tensor:
    """Ids of one step on one rank, table-major: shape (tables, local_batch * ids_per_bag).

    Every bag holds exactly `ids_per_bag` ids drawn uniformly from the table's rows.
    """
    generator = torch.Generator().manual_seed(1_000_003 * rank + step)
    count = local_batch(args, world_size) * args.ids_per_bag
    return torch.randint(0, args.rows, (args.tables, count), generator=generator)


def batch_lengths(args: argparse.Namespace, rank: int, world_size: int, step: int) -> torch.Tensor:
    """Ids per bag of one step on one rank, table-major: shape (tables * local_batch,).

    `--lengths uniform` spreads them over 0 .. 2 x ids_per_bag (the same mean as fixed), so a
    batch mixes empty, short and long sequences, as real histories do.
    """
    shape = (args.tables * local_batch(args, world_size),)
    if getattr(args, "lengths", "fixed") == "fixed":
        return torch.full(shape, args.ids_per_bag)
    generator = torch.Generator().manual_seed(2_000_003 * rank + step + 7)
    return torch.randint(0, 2 * args.ids_per_bag + 1, shape, generator=generator)


def batch_features(
    args: argparse.Namespace, rank: int, world_size: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, lengths) of one step on one rank in the keyed-jagged order (table-major, then
    sample): batch_ids with fixed lengths; otherwise batch_lengths' lengths and as many ids,
    drawn uniformly from the table's rows."""
    lengths = batch_lengths(args, rank, world_size, step)
    if getattr(args, "lengths", "fixed") == "fixed":
        return batch_ids(args, rank, world_size, step).flatten(), lengths
    generator = torch.Generator().manual_seed(1_000_003 * rank + step)
    return torch.randint(0, args.rows, (int(lengths.sum()),), generator=generator), lengths


def peak_rss_gb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def time_steps(step: Callable[[int], Any], args: argparse.Namespace) -> list[float]:
    """Milliseconds per step after warm-up, each the slowest rank's (a barrier before each step)."""
    for index in range(args.warmup):
        step(index)
    times = []
    for index in range(args.warmup, args.warmup + args.steps):
        dist.barrier()
        started = time.perf_counter()
        step(index)
        times.append(1000 * max_over_ranks(time.perf_counter() - started))
    return times


def write_result(
    args: argparse.Namespace, variant: str, step_ms: list[float], init_s: float, **extra: Any
) -> None:
    """Gather peak RSS from every rank; rank 0 writes the JSON result."""
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_rss_gb())
    if dist.get_rank() == 0:
        median_ms = statistics.median(step_ms)
        row_bytes = DTYPE_BYTES[args.dtype]
        lookups = args.batch * args.tables * args.ids_per_bag
        Path(args.result).write_text(
            json.dumps(
                {
                    "variant": variant,
                    "plan": args.plan,
                    "dtype": args.dtype,
                    "ms_per_step": median_ms,
                    "step_ms": step_ms,
                    "lookups_per_s": lookups / (median_ms / 1000),
                    "init_s": init_s,
                    "peak_rss_gb_per_rank": peaks,
                    "table_gb": args.tables * args.rows * args.dim * row_bytes / 2**30,
                    **extra,
                },
                indent=2,
            )
        )
