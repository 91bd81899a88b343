"""The disk tier: a table block's rows and optimizer state in files, a bounded cache in memory.

    emb = shard_embeddings(ebc, strategy, plan=plan, optimizer=Adam(lr=1e-3),
                           disk_tier=DiskTier("runs/tables", cache_bytes=2 * 2**30))

A table placed `on_disk` (plan.py) keeps, on each rank, one file per tensor of its block (the
weights in the table's dtype, each optimizer state in float32) under `directory`, and in memory
a cache of slots: the module's weight and the fused optimizer's state *are* the cache tensors.
Each step, once the ids reach their owner, the shard's local rows are mapped to slots (fetching
missing rows, evicting unpinned ones, writing dirty victims back), so the lookup, the row
grouping and the fused update run unchanged on the cache; the step's slots stay pinned from
forward to backward, and the update writes through the cache (its rows are marked dirty).

Files are reserved with fallocate (no bytes written: a 36 GB table costs no 36 GB of writes at
start, and a full disk is reported before training instead of a SIGBUS later); rows never
written are generated on first use by table_init with the optimizer's initial state. The files
are memory-mapped and the mapped pages are released (madvise DONTNEED) after each step's IO, so
resident memory stays about the cache: file pages mapped into a process count as its RSS.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.plan import Shard, format_bytes
from manualpar.embeddings.row_cache import POLICIES, CacheFull, RowCache
from manualpar.embeddings.table_init import init_rows, init_rows_at
from manualpar.embeddings.update_rules import SparseOptimizer
from manualpar.errors import BuilderError, EmbeddingInputError

__all__ = ["DiskTable", "DiskTables", "DiskTier"]

CHUNK_ROWS = 1 << 16  # rows per pass when a whole file is written (bounded temporaries)


@dataclass(frozen=True)
class DiskTier:
    """Where disk tables live and how much of them each rank caches.

    `cache_rows`: slots per table block on each rank; or `cache_bytes`: the rank's cache for all
    its disk tables together (weights + optimizer state), split in proportion to their blocks.
    `policy`: "lru" (default; measured ahead of LFU on Zipf ids, docs/embeddings.md) or "lfu".
    """

    directory: str | os.PathLike[str]
    cache_rows: int | None = None
    cache_bytes: int | None = None
    policy: str = "lru"

    def __post_init__(self) -> None:
        if (self.cache_rows is None) == (self.cache_bytes is None):
            raise BuilderError(
                "DiskTier: give exactly one of cache_rows= (slots per table block) or "
                "cache_bytes= (each rank's cache for all its disk tables)"
            )
        for name in ("cache_rows", "cache_bytes"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise BuilderError(f"DiskTier: {name} must be a positive int, got {value!r}")
        if self.policy not in POLICIES:
            raise BuilderError(f"DiskTier: policy must be one of {POLICIES}, got {self.policy!r}")

    def slots(self, blocks: Mapping[str, tuple[int, int]]) -> dict[str, int]:
        """Cache slots per table from {table: (block rows, bytes per row)}: `cache_rows` each,
        or `cache_bytes` split in proportion to the blocks' bytes (at most the block's rows)."""
        if self.cache_rows is not None:
            return {name: min(self.cache_rows, rows) for name, (rows, _) in blocks.items()}
        assert self.cache_bytes is not None
        total = sum(rows * width for rows, width in blocks.values()) or 1
        return {
            name: max(1, min(rows, self.cache_bytes * rows // total))
            for name, (rows, _) in blocks.items()
        }


def _mapped(path: Path, nbytes: int, what: str) -> mmap.mmap:
    """A new file of `nbytes` reserved on disk (fallocate: unwritten blocks read as zeros),
    mapped shared. A directory that cannot be written or a full disk raise BuilderError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as error:
        raise BuilderError(
            f"disk tier: cannot write {what} file {str(path)!r}: {error.strerror}; give "
            "DiskTier(directory=...) a directory this process can write"
        ) from None
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            free = shutil.disk_usage(path.parent).free
            path.unlink(missing_ok=True)
            reason = "the disk is full" if error.errno == errno.ENOSPC else error.strerror
            raise BuilderError(
                f"disk tier: cannot reserve {format_bytes(nbytes)} for {what} file "
                f"{str(path)!r} ({reason}; {format_bytes(free)} free there); free disk space, "
                "choose another DiskTier(directory=...), or keep fewer tables on disk"
            ) from None
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file open


class DiskTable:
    """One table's block on this rank: its files and the RowCache of its cache tensors."""

    def __init__(
        self,
        config: EmbeddingBagConfig,
        seed: int,
        shard: Shard,
        rule: SparseOptimizer,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        directory: Path,
        rank: int,
        policy: str,
    ) -> None:
        self.config, self.seed, self.shard, self.rank = config, seed, shard, rank
        self.weight, self.state = weight, state  # the cache tensors (module's and optimizer's)
        self.cache = RowCache(shard.rows, weight.shape[0], policy)
        self.initial = {k: v[:1].clone() for k, v in rule.init_state(1, shard.cols).items()}
        stem = f"{config.name}.rows{shard.row_start}.cols{shard.col_start}.rank{rank}"
        self._maps: list[mmap.mmap] = []
        self.file_weight = self._file(directory / f"{stem}.weight", weight.dtype, shard.cols)
        self.file_state = {
            key: self._file(
                directory / f"{stem}.{key}",
                torch.float32,
                shard.cols if tensor.dim() == 2 else 0,
            )
            for key, tensor in state.items()
        }
        self.paths = [directory / f"{stem}.{k}" for k in ("weight", *state)]

    def _file(self, path: Path, dtype: torch.dtype, cols: int) -> torch.Tensor:
        rows = self.shard.rows
        nbytes = rows * max(cols, 1) * dtype.itemsize
        mapped = _mapped(path, nbytes, f"table {self.config.name!r} (rank {self.rank})")
        self._maps.append(mapped)
        flat = torch.frombuffer(mapped, dtype=dtype)
        return flat.view(rows, cols) if cols else flat

    def release_pages(self) -> None:
        """Unmap the file pages this process touched (their data stays in the page cache and
        the file): mapped pages count as resident memory."""
        for mapped in self._maps:
            mapped.madvise(mmap.MADV_DONTNEED)

    # a step -------------------------------------------------------------------------------------
    def to_slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache slot of each local row id (same shape), and the distinct slots pinned."""
        rows, inverse = torch.unique(ids, return_inverse=True)
        try:
            assignment = self.cache.assign(rows.cpu())
        except CacheFull as full:
            raise EmbeddingInputError(
                f"disk tier: table {self.config.name!r} on rank {self.rank} needs "
                f"{full.needed} distinct rows in its cache at once (this step's rows), but the "
                f"cache holds {full.capacity} rows; raise DiskTier(cache_rows=...) to at least "
                f"{full.needed} (or cache_bytes=...), or use smaller batches"
            ) from None
        io = assignment.evict_rows.numel() + assignment.fetch_rows.numel()
        if assignment.evict_rows.numel():
            self._write_back(assignment.evict_rows, assignment.evict_slots)
        if assignment.fetch_rows.numel():
            self._fetch(assignment.fetch_rows, assignment.fetch_slots, assignment.stored)
        if io:
            self.release_pages()
        slots = assignment.slots.to(ids.device)
        return slots[inverse], slots

    def _write_back(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        device_slots = slots.to(self.weight.device)
        self.file_weight.index_copy_(0, rows, self.weight.index_select(0, device_slots).cpu())
        for key, tensor in self.state.items():
            self.file_state[key].index_copy_(0, rows, tensor.index_select(0, device_slots).cpu())

    def _fetch(self, rows: torch.Tensor, slots: torch.Tensor, stored: torch.Tensor) -> None:
        device = self.weight.device
        if bool(stored.any()):
            old, into = rows[stored], slots[stored].to(device)
            self.weight.index_copy_(0, into, self.file_weight.index_select(0, old).to(device))
            for key, tensor in self.state.items():
                tensor.index_copy_(0, into, self.file_state[key].index_select(0, old).to(device))
        fresh = ~stored
        if bool(fresh.any()):
            new, into = rows[fresh], slots[fresh].to(device)
            shard = self.shard
            values = init_rows_at(
                self.config, self.seed, new + shard.row_start, (shard.col_start, shard.col_end)
            )
            self.weight.index_copy_(0, into, values.to(device, self.weight.dtype))
            for key, tensor in self.state.items():
                initial = self.initial[key].to(device).expand(new.numel(), *tensor.shape[1:])
                tensor.index_copy_(0, into, initial)

    # checkpoints --------------------------------------------------------------------------------
    @torch.no_grad()
    def flush(self) -> None:
        """Make the files hold the whole block: dirty cached rows written back, rows never
        written generated (before a checkpoint reads the files)."""
        rows, slots = self.cache.dirty_entries()
        if rows.numel():
            self._write_back(rows, slots)
        shard = self.shard
        for start in range(0, shard.rows, CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, shard.rows)
            never = self.cache.never_written(start, end)
            if not never.numel():
                continue
            values = init_rows(
                self.config,
                self.seed,
                (shard.row_start + start, shard.row_start + end),
                (shard.col_start, shard.col_end),
            )
            target = never + start
            self.file_weight.index_copy_(0, target, values[never].to(self.weight.dtype))
            for key, tensor in self.file_state.items():
                initial = self.initial[key].cpu().expand(never.numel(), *tensor.shape[1:])
                tensor.index_copy_(0, target, initial)
            self.cache.mark_stored(start, end)
            self.release_pages()

    def file_tensor(self, key: str | None) -> torch.Tensor:
        """The file-backed block of the weight (None) or a state tensor, after `flush`."""
        self.flush()
        return self.file_weight if key is None else self.file_state[key]

    def loaded(self) -> None:
        """The files were just written by a checkpoint load: drop the cache (a state_dict()
        before the load flushed it, so nothing is lost)."""
        self.cache.drop_all()
        self.release_pages()

    @torch.no_grad()
    def fill_from(self, source: torch.Tensor) -> None:
        """Start from a real (materialized) table's block, copied in chunks."""
        shard = self.shard
        for start in range(0, shard.rows, CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, shard.rows)
            self.file_weight[start:end] = source[
                shard.row_start + start : shard.row_start + end, shard.col_start : shard.col_end
            ]
            for key, tensor in self.file_state.items():
                tensor[start:end] = self.initial[key].cpu().expand(end - start, *tensor.shape[1:])
            self.release_pages()
        self.cache.mark_stored()

    def close(self) -> None:
        self.release_pages()


class DiskTables:
    """A collection's disk tables on this rank, by table index; maps a step's bags to slots
    and keeps their pins until the step's backward."""

    def __init__(self, tables: Mapping[int, DiskTable] | None = None) -> None:
        self.tables = dict(tables or {})
        self.by_name = {table.config.name: table for table in self.tables.values()}

    def __bool__(self) -> bool:
        return bool(self.tables)

    def begin_step(self) -> None:
        for table in self.tables.values():
            table.cache.new_step()

    def to_slots(
        self, local: list[Any], bags: list[Any], pins: list[tuple[int, torch.Tensor]]
    ) -> list[Any]:
        """One sender's bags for this rank's routed `local` shards, disk tables' ids replaced by
        cache slots; appends the pinned slots to `pins`."""
        mapped = []
        for shard, (ids, lengths, weights) in zip(local, bags, strict=True):
            table = self.tables.get(shard.table)
            if table is not None:
                ids, pinned = table.to_slots(ids)
                pins.append((shard.table, pinned))
            mapped.append((ids, lengths, weights))
        return mapped

    def release(self, pins: list[tuple[int, torch.Tensor]], updated: bool) -> None:
        for t, slots in pins:
            self.tables[t].cache.release(slots.cpu(), updated)
        pins.clear()

    def hit_rate(self) -> float:
        hits = sum(t.cache.hits for t in self.tables.values())
        misses = sum(t.cache.misses for t in self.tables.values())
        return hits / max(hits + misses, 1)
