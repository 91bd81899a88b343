"""The host's memory floor for one step of the embedding benchmark: the rows a rank must read
and write per step, priced at this host's streaming and random-access rates.

A step cannot take less than the time to move its rows: forward reads each routed id's row
from the table (at random positions), backward reads and writes back each touched row and its
optimizer state (row-wise Adagrad: one float32 per row), and the rank writes its output rows
(pooled bags, or one row per id for sequence tables) and reads their gradients (streamed). The
rates come from `probe`, run once at the start of a benchmark on one thread (as each rank
runs), in CPU time: the best of a few tries, since a busy neighbour only ever slows a try
down. The floor is a lower bound: it leaves out ids, exchanges and the arithmetic, and the two
ranks of a run share the memory bandwidth one probe had alone.

Plain torch only (embedding_workload.py draws the ids), so any benchmark can price its step.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy
import torch
from embedding_workload import DTYPE_BYTES, batch_features, local_batch

STATE_BYTES = 4  # row-wise Adagrad: one float32 of state per row
OUTPUT_BYTES = 4  # outputs and their gradients are float32 whatever the rows' dtype


@dataclass(frozen=True)
class HostRates:
    """Bytes per second on one thread: a large copy (read and write both counted), rows
    gathered from random positions of a table larger than the cache, rows scattered there."""

    stream: float
    random_read: float
    random_write: float


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one rank moves in one step: table rows (and their state) at random positions, and
    its output rows and their gradients, streamed."""

    random_read: int
    random_write: int
    stream: int

    def seconds(self, rates: HostRates) -> float:
        return (
            self.random_read / rates.random_read
            + self.random_write / rates.random_write
            + self.stream / rates.stream
        )


def probe(
    row_bytes: int, table_mib: int = 256, rows_per_try: int = 1 << 16, tries: int = 5
) -> HostRates:
    """This host's rates on one thread, for rows of `row_bytes` in a `table_mib` MiB table (8x
    a large last-level cache), each the fastest plain copy at hand: torch's index_select
    gathers; numpy's fancy assignment of whole rows (one memcpy each) scatters, where torch's
    index_copy_ measured 25x slower than memory here. Distinct values fill the table: on some
    hosts pages of one constant are shared and read faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = table_mib * 2**20 // row_bytes // 4 * 4
        table = torch.arange(rows * row_bytes // 4, dtype=torch.int32).view(torch.uint8)
        table = table.view(rows, row_bytes)
        half = table[: rows // 2].clone()
        ids = torch.randint(0, rows, (rows_per_try,), generator=torch.Generator().manual_seed(0))
        out = torch.empty(rows_per_try, row_bytes, dtype=torch.uint8)
        as_rows = numpy.dtype((numpy.void, row_bytes))  # a row as one item: one memcpy a row
        table_rows, out_rows = (t.numpy().view(as_rows).reshape(-1) for t in (table, out))
        picked = ids.numpy()
        moved = rows_per_try * row_bytes

        def scatter() -> None:
            table_rows[picked] = out_rows

        return HostRates(
            stream=2 * half.numel() / _best(lambda: half.copy_(table[rows // 2 :]), tries),
            random_read=moved / _best(lambda: torch.index_select(table, 0, ids, out=out), tries),
            random_write=moved / _best(scatter, tries),
        )
    finally:
        torch.set_num_threads(threads)


def _best(run: Any, tries: int) -> float:
    """The fastest of `tries` runs of `run()` after one warm-up, in seconds of this thread's CPU
    time: on a loaded host the wall clock also counts the time other processes ran, which is
    no property of its memory."""
    run()
    best = float("inf")
    for _ in range(tries):
        started = time.thread_time()
        run()
        best = min(best, time.thread_time() - started)
    return best


def rank_traffic(args: argparse.Namespace, rank: int, world: int, step: int = 0) -> StepTraffic:
    """What `rank` moves in step `step` of the workload `args` (embedding_workload's: plan,
    tables, rows, dim, batch, ids_per_bag, lengths, sequence, dtype): the ids every rank sends
    it, as the benchmark's plans place the tables (table-wise: table i on rank i * world //
    tables; row-wise: an even block of every table's rows)."""
    row_bytes = args.dim * DTYPE_BYTES[getattr(args, "dtype", "fp32")]
    held = _routed_ids(args, rank, world, step)
    looked_up = sum(ids.numel() for ids in held)
    touched = sum(ids.unique().numel() for ids in held)
    if getattr(args, "sequence", False):
        outputs = looked_up  # one row per id
    else:  # table-wise: every rank's bags of its tables; row-wise: partial sums of every bag
        outputs = world * local_batch(args, world) * len(held)
    return StepTraffic(
        random_read=looked_up * row_bytes + touched * (row_bytes + STATE_BYTES),
        random_write=touched * (row_bytes + STATE_BYTES),
        stream=2 * outputs * args.dim * OUTPUT_BYTES,
    )


def _routed_ids(args: argparse.Namespace, rank: int, world: int, step: int) -> list[torch.Tensor]:
    """Per table `rank` holds, the ids of it that every rank's batch of step `step` routes to
    `rank` (its rows' ids, all of them table-wise)."""
    bags = local_batch(args, world)
    if args.plan == "table_wise":
        mine = [t for t in range(args.tables) if t * world // args.tables == rank]
        lo, hi = 0, args.rows
    else:
        mine = list(range(args.tables))
        lo, hi = args.rows * rank // world, args.rows * (rank + 1) // world
    per_table: list[list[torch.Tensor]] = [[] for _ in mine]
    for sender in range(world):
        ids, lengths = batch_features(args, sender, world, step)
        split = ids.split(lengths.view(args.tables, bags).sum(1).tolist())
        for k, t in enumerate(mine):
            per_table[k].append(split[t][(split[t] >= lo) & (split[t] < hi)])
    return [torch.cat(parts) for parts in per_table]


def step_floor(args: argparse.Namespace, world: int, rates: HostRates) -> dict[str, Any]:
    """The workload's floor: the slowest rank's traffic at `rates`, in milliseconds, with each
    rank's bytes and the rates (bytes per second) for the JSON."""
    traffic = [rank_traffic(args, rank, world) for rank in range(world)]
    return {
        "ms": 1000 * max(t.seconds(rates) for t in traffic),
        "bytes_per_rank": [asdict(t) for t in traffic],
        "rates_bytes_per_s": asdict(rates),
    }


class Floors:
    """Floors of the workloads of one run, each host rate probed once per row size (at the
    first workload that needs it: the start of the run)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.rates: dict[int, HostRates] = {}

    def of(self, args: argparse.Namespace, **workload: Any) -> dict[str, Any]:
        """The floor of `args` with `workload`'s fields (plan, rows, dtype) put in."""
        args = argparse.Namespace(**{**vars(args), **workload})
        row_bytes = args.dim * DTYPE_BYTES[getattr(args, "dtype", "fp32")]
        if row_bytes not in self.rates:
            self.rates[row_bytes] = probe(row_bytes)
        return step_floor(args, self.world, self.rates[row_bytes])


def times_floor(ms_per_step: float, floor: dict[str, Any]) -> float:
    """A step as a multiple of its floor."""
    return ms_per_step / floor["ms"]


def add_floor(summary: dict[str, Any], floor: dict[str, Any]) -> str:
    """Put `floor` ("memory_floor") and each variant's step as a multiple of it
    ("x_memory_floor") into `summary`, one workload's summary with its "median_ms_per_step" per
    variant; returns the line to print."""
    summary["memory_floor"] = floor
    summary["x_memory_floor"] = {
        name: times_floor(ms, floor) for name, ms in summary["median_ms_per_step"].items()
    }
    return f"{describe(floor)}; step / memory floor: " + ", ".join(
        f"{name} {x:.1f}x" for name, x in summary["x_memory_floor"].items()
    )


def describe(floor: dict[str, Any]) -> str:
    """The floor in words: milliseconds and the slowest rank's megabytes."""
    moved = max(floor["bytes_per_rank"], key=lambda b: sum(b.values()))
    return (
        f"memory floor {floor['ms']:.1f} ms ({moved['random_read'] / 1e6:.0f} MB read and "
        f"{moved['random_write'] / 1e6:.0f} MB written at random, {moved['stream'] / 1e6:.0f} MB "
        "streamed a rank)"
    )
