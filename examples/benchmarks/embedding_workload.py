"""The embedding benchmark's workload and measurement protocol, shared by every variant.

Plain torch only (no manualpar import): the TorchRec peer runs this module from its own virtual
environment. Every variant sees the same ids: batch `step` of rank `rank` is drawn from a
generator seeded by (rank, step), so variants differ only in how they look the ids up.

`--ids zipf --zipf-exponent S` draws each table's ids from a Zipf law instead of uniformly: a
rank k in 1..rows with probability proportional to k^-S (inverse CDF over the exact weights),
mapped to a row through a fixed random permutation per table (torch.randperm seeded by the table's
index), so the hot rows are spread over the table and over the row-wise blocks rather than all at
its start. Those draws cost about 10 ms a step on 1M rows, so `time_steps` draws every step's
ids before it starts the clock (`predraw`) for every variant alike; uniform ids are drawn inside
the step, as they always were (about 1 ms).

A worker writes one JSON result (see `write_result`) that bench_embeddings.py collects.
"""

from __future__ import annotations

import argparse
import functools
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
# --ids: each table's ids uniform over its rows, or Zipf-distributed (--zipf-exponent)
ID_DISTRIBUTIONS = ("uniform", "zipf")


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
    add_id_args(parser)


def add_id_args(parser: argparse.ArgumentParser) -> None:
    """--ids and --zipf-exponent (the workers' and bench_embeddings.py's command line)."""
    parser.add_argument(
        "--ids",
        choices=ID_DISTRIBUTIONS,
        default="uniform",
        help="each table's ids: uniform over its rows, or Zipf (hot rows spread by a permutation)",
    )
    parser.add_argument(
        "--zipf-exponent", type=float, default=1.05, help="--ids zipf: P(k-th hottest row) ~ k^-S"
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

    Every bag holds exactly `ids_per_bag` ids drawn from the table's rows (uniformly, or as
    --ids zipf says).
    """
    generator = torch.Generator().manual_seed(1_000_003 * rank + step)
    count = local_batch(args, world_size) * args.ids_per_bag
    if _zipf(args):
        drawn = _DRAWN.get(_draw_key(args, rank, world_size, step))
        if drawn is not None and getattr(args, "lengths", "fixed") == "fixed":
            return drawn.clone().view(args.tables, count)
        return _zipf_ids(args, generator, (count,) * args.tables).view(args.tables, count)
    return torch.randint(0, args.rows, (args.tables, count), generator=generator)


def _zipf(args: argparse.Namespace) -> bool:
    return getattr(args, "ids", "uniform") == "zipf"


# (workload, rank, world size, step) -> that step's Zipf ids, filled by `predraw`
_DRAWN: dict[tuple, torch.Tensor] = {}


def _draw_key(args: argparse.Namespace, rank: int, world_size: int, step: int) -> tuple:
    fields = ("tables", "rows", "batch", "ids_per_bag", "lengths", "zipf_exponent")
    return (*(getattr(args, f, None) for f in fields), rank, world_size, step)


def _zipf_ids(
    args: argparse.Namespace, generator: torch.Generator, counts: tuple[int, ...]
) -> torch.Tensor:
    """counts[t] ids of table t, table-major: Zipf ranks (inverse CDF of uniform doubles)
    mapped through table t's fixed permutation of its rows."""
    u = torch.rand(sum(counts), dtype=torch.float64, generator=generator)
    cdf = zipf_cdf(args.rows, args.zipf_exponent)
    ranks = torch.searchsorted(cdf, u, right=True).clamp_(max=args.rows - 1)
    return torch.cat(
        [row_permutation(args.rows, t)[r] for t, r in enumerate(ranks.split(list(counts)))]
    )


@functools.lru_cache(maxsize=2)
def zipf_cdf(rows: int, exponent: float) -> torch.Tensor:
    """P(rank <= k) for k = 0 .. rows - 1 when P(rank k) ~ (k + 1)^-exponent (float64)."""
    cdf = torch.arange(1, rows + 1, dtype=torch.float64).pow_(-exponent).cumsum_(0)
    return cdf.div_(cdf[-1].item())


@functools.lru_cache(maxsize=64)
def row_permutation(rows: int, table: int) -> torch.Tensor:
    """Table `table`'s fixed map from Zipf rank to row: the hottest ids land anywhere."""
    return torch.randperm(rows, generator=torch.Generator().manual_seed(3_000_017 + table))


def predraw(args: argparse.Namespace, rank: int, world_size: int, steps: int) -> None:
    """With --ids zipf, draw steps 0 .. steps - 1's ids of this rank now (the workers' later
    batch_ids / batch_features calls get copies), then free the draw's tables."""
    if not _zipf(args):
        return
    for step in range(steps):
        key = _draw_key(args, rank, world_size, step)
        _DRAWN[key] = batch_features(args, rank, world_size, step)[0]
    zipf_cdf.cache_clear()
    row_permutation.cache_clear()


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
    drawn = _DRAWN.get(_draw_key(args, rank, world_size, step)) if _zipf(args) else None
    if drawn is not None:
        return drawn.clone(), lengths
    if getattr(args, "lengths", "fixed") == "fixed":
        return batch_ids(args, rank, world_size, step).flatten(), lengths
    generator = torch.Generator().manual_seed(1_000_003 * rank + step)
    if _zipf(args):
        counts = tuple(int(n) for n in lengths.view(args.tables, -1).sum(1))
        return _zipf_ids(args, generator, counts), lengths
    return torch.randint(0, args.rows, (int(lengths.sum()),), generator=generator), lengths


def peak_rss_gb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def time_steps(step: Callable[[int], Any], args: argparse.Namespace) -> list[float]:
    """Milliseconds per step after warm-up, each the slowest rank's (a barrier before each step);
    --ids zipf draws every step's ids first (`predraw`)."""
    predraw(args, dist.get_rank(), dist.get_world_size(), args.warmup + args.steps)
    for index in range(args.warmup):
        step(index)
    times = []
    STEP_CPU_MS.clear()
    for index in range(args.warmup, args.warmup + args.steps):
        dist.barrier()
        started, cpu = time.perf_counter(), time.process_time()
        step(index)
        spent = torch.tensor(
            [time.perf_counter() - started, time.process_time() - cpu], dtype=torch.float64
        )
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)  # the slowest rank's, one collective
        times.append(1000 * spent[0].item())
        STEP_CPU_MS.append(1000 * spent[1].item())
    return times


# the last `time_steps`' CPU milliseconds per step (this process, all its threads), each the
# busiest rank's: unlike the wall clock, not stretched by other processes on a loaded host
STEP_CPU_MS: list[float] = []


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
                    "cpu_ms_per_step": statistics.median(STEP_CPU_MS) if STEP_CPU_MS else None,
                    "step_cpu_ms": list(STEP_CPU_MS),
                    "lookups_per_s": lookups / (median_ms / 1000),
                    "init_s": init_s,
                    "peak_rss_gb_per_rank": peaks,
                    "table_gb": args.tables * args.rows * args.dim * row_bytes / 2**30,
                    **extra,
                },
                indent=2,
            )
        )
