"""A plan as text that stays readable at any world size.

Up to SPELLED_OUT ranks every block and every rank's bytes are listed, as before. Past that, a
table replicated on 1,024 ranks would print `r0:rows[0:128]` 1,024 times on one line, so runs
of consecutive ranks holding blocks of one shape become one range (`r0-r1023: rows[0:128]
each`, `r0-r1023: rows[0:131072] in 1024 blocks of 128`), and per-rank bytes become a summary
(min, median, max, and the busiest ranks by name).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Protocol


class Shard(Protocol):
    """What is read of a plan's block (plan.Shard; a protocol, so that plan.py can import this
    file without a cycle)."""

    @property
    def rank(self) -> int: ...

    @property
    def row_start(self) -> int: ...

    @property
    def row_end(self) -> int: ...

    @property
    def col_start(self) -> int: ...

    @property
    def col_end(self) -> int: ...

    @property
    def rows(self) -> int: ...

    @property
    def cols(self) -> int: ...


__all__ = ["SPELLED_OUT", "per_rank_text", "shards_text"]

SPELLED_OUT = 8  # ranks (or blocks) listed one by one; more are summarized
BUSIEST = 3  # ranks named beside the maximum


def _block(shard: Shard, dim: int) -> str:
    cols = f"cols[{shard.col_start}:{shard.col_end}]" if shard.cols != dim else ""
    return f"rows[{shard.row_start}:{shard.row_end}]{cols}"


def _ranks(first: int, last: int) -> str:
    return f"r{first}" if first == last else f"r{first}-r{last}"


def shards_text(shards: Sequence[Shard], dim: int) -> str:
    """`r0:rows[0:10], r1:rows[10:20]`, or with many blocks, ranges of equal blocks."""
    if len(shards) <= SPELLED_OUT:
        return ", ".join(f"r{s.rank}:{_block(s, dim)}" for s in shards)
    runs: list[list[Shard]] = []
    for shard in shards:
        run = runs[-1] if runs else None
        if run is not None and _continues(run, shard):
            run.append(shard)
        else:
            runs.append([shard])
    return ", ".join(_run_text(run, dim) for run in runs)


def _continues(run: list[Shard], shard: Shard) -> bool:
    """`shard` extends `run`: the next rank, a block of the same shape, and the same rows again
    (replicas) or the next rows (a row split), whichever the run's first two blocks began."""
    last = run[-1]
    if shard.rank != last.rank + 1:
        return False
    if (shard.rows, shard.col_start, shard.col_end) != (last.rows, last.col_start, last.col_end):
        return False
    if len(run) == 1:
        return shard.row_start in (last.row_start, last.row_end)
    replicas = run[1].row_start == run[0].row_start
    return shard.row_start == (last.row_start if replicas else last.row_end)


def _run_text(run: list[Shard], dim: int) -> str:
    first, last = run[0], run[-1]
    ranks = _ranks(first.rank, last.rank)
    if len(run) == 1 or first.row_start == last.row_start:
        return f"{ranks}: {_block(first, dim)}" + (" each" if len(run) > 1 else "")
    cols = f"cols[{first.col_start}:{first.col_end}]" if first.cols != dim else ""
    return (
        f"{ranks}: rows[{first.row_start}:{last.row_end}]{cols} in {len(run)} blocks of "
        f"{first.rows}"
    )


def per_rank_text(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """`r0: 1.0 MiB, r1: 2.0 MiB`, or with many ranks min / median / max and the busiest."""
    if len(values) <= SPELLED_OUT:
        return ", ".join(f"r{r}: {fmt(v)}" for r, v in enumerate(values))
    low, high = min(values), max(values)
    middle = statistics.median(values)
    if all(isinstance(v, int) for v in values):
        middle = int(middle)  # bytes stay whole
    busiest = [r for r, value in enumerate(values) if value == high]
    named = ", ".join(f"r{r}" for r in busiest[:BUSIEST]) + (
        ", ..." if len(busiest) > BUSIEST else ""
    )
    return (
        f"min {fmt(low)} (r{values.index(low)}), median {fmt(middle)}, "
        f"max {fmt(high)} ({named}) over {len(values)} ranks"
    )
