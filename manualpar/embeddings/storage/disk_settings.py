"""DiskTier: where a collection's disk tables live, and how much of them each rank caches (the
tier itself is disk_tier.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from manualpar.embeddings.storage.row_cache import (
    EVICT_FRACTION,
    LOGGED,
    POLICIES,
    index_bytes,
)
from manualpar.errors import BuilderError

__all__ = ["MAX_LOG_ROWS", "DiskTier"]

MAX_LOG_ROWS = LOGGED - torch.iinfo(torch.int32).min + 1  # its records' slot_of codes are int32


@dataclass(frozen=True)
class DiskTier:
    """Where disk tables live and how much of them each rank caches.

    `cache_rows`: slots per table block on each rank; or `cache_bytes`: the rank's cache for all
    its disk tables together (weights + optimizer state), split in proportion to their blocks,
    the evicted rows on their way to the file included (a 1/17 of it).
    `policy`: "lrfu" (default: the last use plus a few steps per use while cached, LFU's
    fewer misses on steady ids without keeping yesterday's hot rows once they shift), "lru" or
    "lfu" (row_cache.py, docs/embeddings-storage.md). `io_threads`: threads reading a step's
    missing rows (reads that wait on the device overlap; writes go one at a time, see
    DiskTable).
    `write_log`: each block's write log (write_log.py), in multiples of its cache slots (at
    most the block's rows): evicted rows are appended there and written to their places in the
    background once it is half full (background_drain.py), and before a checkpoint; 0: evicted
    rows go straight to their places.
    """

    directory: str | os.PathLike[str]
    cache_rows: int | None = None
    cache_bytes: int | None = None
    policy: str = "lrfu"
    io_threads: int = 4
    write_log: float = 4.0

    def __post_init__(self) -> None:
        if (self.cache_rows is None) == (self.cache_bytes is None):
            raise BuilderError(
                "DiskTier: give exactly one of cache_rows= (slots per table block) or "
                "cache_bytes= (each rank's cache for all its disk tables)"
            )
        for name in ("cache_rows", "cache_bytes", "io_threads"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise BuilderError(f"DiskTier: {name} must be a positive int, got {value!r}")
        if self.policy not in POLICIES:
            raise BuilderError(f"DiskTier: policy must be one of {POLICIES}, got {self.policy!r}")
        log = self.write_log
        if isinstance(log, bool) or not isinstance(log, int | float) or not 0 <= log < 2**31:
            raise BuilderError(
                f"DiskTier: write_log must be a number >= 0 (the write log's size in cache "
                f"sizes; 0 for none), got {log!r}"
            )

    def log_rows(self, slots: int, rows: int) -> int:
        """Write-log records for a block of `rows` rows cached in `slots` slots."""
        return min(int(self.write_log * slots), rows, MAX_LOG_ROWS)

    def slots(self, blocks: Mapping[str, tuple[int, int]]) -> dict[str, int]:
        """Cache slots per table from {table: (block rows, bytes per row)}: `cache_rows` each,
        or `cache_bytes` split in proportion to the blocks' bytes (at most the block's rows)."""
        one_row = sum(width for _, width in blocks.values())
        if self.cache_bytes is not None and self.cache_bytes < one_row:
            widths = ", ".join(f"{name}: {width} B" for name, (_, width) in blocks.items())
            raise BuilderError(
                f"DiskTier(cache_bytes={self.cache_bytes}) cannot hold one row of each disk "
                f"table on this rank ({one_row} bytes: {widths}, weights and optimizer state); "
                "a step needs a cache slot for every distinct row it looks up, so give "
                "cache_bytes= room for at least a batch's rows (or cache_rows= per table)"
            )
        return self._split(blocks)

    def _split(self, blocks: Mapping[str, tuple[int, int]]) -> dict[str, int]:
        """`slots` without its check (the planner's figures take any cache)."""
        if self.cache_rows is not None:
            return {name: min(self.cache_rows, rows) for name, (rows, _) in blocks.items()}
        assert self.cache_bytes is not None
        total = sum(rows * width for rows, width in blocks.values()) or 1
        # A block's evicted rows are copied out of the cache and written in the background, up
        # to a 1/EVICT_FRACTION of its slots at a time (BackgroundWrites): room kept for them,
        # so the slots and the rows on their way to the file stay within cache_bytes. Without
        # it, peak RSS rose 70 MiB over the per-row writes' in the documented workload.
        rows_bytes = self.cache_bytes * EVICT_FRACTION // (EVICT_FRACTION + 1)
        return {
            name: max(1, min(rows, rows_bytes * rows // total))
            for name, (rows, _) in blocks.items()
        }

    def cache_memory(self, blocks: Mapping[str, tuple[int, int]]) -> int:
        """Bytes the cache takes on a rank holding `blocks` ({table: (block rows, bytes per
        row)}): all of cache_bytes once it holds any block, or cache_rows rows of each (at most
        its block's) and the evicted rows on their way to the file (up to a 1/EVICT_FRACTION
        of its slots, rounded up: what cache_bytes keeps room for), plus each block's
        bookkeeping (row_cache.py, `index_bytes`: 4 bytes a block row, 37 a slot). The planner
        counts it against the memory budget (cached_tier.py)."""
        slots = self._split(blocks)
        index = sum(index_bytes(rows, slots[name]) for name, (rows, _) in blocks.items())
        if self.cache_bytes is not None:
            return (self.cache_bytes if blocks else 0) + index
        in_flight = {name: -(-count // EVICT_FRACTION) for name, count in slots.items()}
        return index + sum(
            (slots[name] + in_flight[name]) * width for name, (_, width) in blocks.items()
        )
