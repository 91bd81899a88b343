"""The disk tier: a table block's rows and optimizer state in files, a bounded cache in memory.

    emb = shard_embeddings(ebc, strategy, plan=plan, optimizer=Adam(lr=1e-3),
                           disk_tier=DiskTier("runs/tables", cache_bytes=2 * 2**30))

A table placed `on_disk` (plan.py) keeps, on each rank, one file of its block under `directory`
(row_file.py: a record per row, the weights in the table's dtype and the optimizer state in
float32), and in memory a cache of slots: the module's weight and the fused optimizer's state
*are* the cache tensors. Each step, once the ids reach their owner, the shard's local rows are
mapped to slots (fetching missing rows, evicting unpinned ones, writing dirty victims back), so
the lookup, the row grouping and the fused update run unchanged on the cache; the step's slots
stay pinned from forward to backward, and the update writes through the cache (its rows are
marked dirty, written back when evicted and before a checkpoint). Evicted rows are appended to
the file's write log (write_log.py), written in the background while the step goes on
(background_writes.py); a row read back while its batch is on its way comes from that batch's
records, without waiting for the write.

Rows never written are generated on first use by table_init with the optimizer's initial state,
so the file starts reserved but unwritten. Rows move with pread/pwrite, so resident memory
stays about the cache (no file pages are mapped during training).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from manualpar.checkpoint.local_shards import current_load
from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.modules.table_init import init_rows, init_rows_into
from manualpar.embeddings.plan import Shard
from manualpar.embeddings.storage.background_writes import BackgroundWrites
from manualpar.embeddings.storage.disk_settings import DiskTier
from manualpar.embeddings.storage.field_writes import FieldWrites
from manualpar.embeddings.storage.load_gaps import LoadGaps
from manualpar.embeddings.storage.row_cache import (
    NEVER,
    STORED,
    CacheFull,
    RowCache,
    log_record_of,
)
from manualpar.embeddings.storage.row_file import RowFile
from manualpar.embeddings.storage.write_log import WriteLog
from manualpar.errors import CheckpointError, EmbeddingInputError

__all__ = ["CacheTooSmall", "DiskTable", "DiskTier", "hit_rate"]

CHUNK_BYTES = 64 * 2**20  # records per pass over a whole file (flush, fill)
# A checkpoint holds one chunk's mapped file pages and its copy at a time (CHECKPOINT_), and
# `flush`, generating the rows never written, a chunk's records, values and a copy of each
# (FLUSH_). Measured per rank on a 196 MB block (2 ranks, 1M rows x 48 each): peak RSS rose
# 300 MiB in a checkpoint with 64 MiB chunks for both, 52 MiB with 16 MiB and 4 MiB ones, 37 MiB
# with these (docs/benchmarks.md, "Disk-tier checkpoints").
CHECKPOINT_CHUNK_BYTES = 8 * 2**20
FLUSH_CHUNK_BYTES = 4 * 2**20


class CacheTooSmall(EmbeddingInputError):
    """A step's rows do not fit the cache beside the rows pinned already (a prefetched
    batch's, say): raised by `to_slots`, naming the table, the rank and the size to set."""


class DiskTable:
    """One table's block on this rank, a RowStore (tier.py): its RowFile and the RowCache of
    its cache tensors. `initial_state`: the optimizer state of a row never updated (one row
    per key), given to rows generated on first use."""

    def __init__(
        self,
        config: EmbeddingBagConfig,
        seed: int,
        shard: Shard,
        initial_state: Mapping[str, torch.Tensor],
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        directory: Path,
        rank: int,
        policy: str,
        io_threads: int = 1,
        log_rows: int = 0,
    ) -> None:
        self.config, self.seed, self.shard, self.rank = config, seed, shard, rank
        self.weight, self.state = weight, state  # the cache tensors (module's and optimizer's)
        self.directory = Path(directory)
        self.cache = RowCache(shard.rows, weight.shape[0], policy)
        self.initial = {k: v[:1].clone() for k, v in initial_state.items()}
        stem = f"{config.name}.rows{shard.row_start}.cols{shard.col_start}.rank{rank}"
        self.file = RowFile(
            Path(directory) / f"{stem}.rows",
            shard.rows,
            shard.cols,
            weight.dtype,
            {key: tensor.dim() == 1 for key, tensor in state.items()},
            f"table {config.name!r} (rank {rank})",
            io_threads,
            log_rows,
        )
        self.write_back = BackgroundWrites(self.file)
        self.chunk_rows = max(1, CHUNK_BYTES // self.file.record)
        self.checkpoint_rows = max(1, CHECKPOINT_CHUNK_BYTES // self.file.record)
        self.flush_rows = max(1, FLUSH_CHUNK_BYTES // self.file.record)
        self.log = WriteLog(self.file, self.cache, self.write_back, self.flush_rows)
        self.load_writes = FieldWrites(self.file)
        self.gaps = LoadGaps([None, *state], self.initial)  # what a load left to fill

    # a step -------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.cache.new_step()
        self.log.step()  # the background drain's next piece (background_drain.py)

    def release(self, pinned: torch.Tensor, updated: bool) -> None:
        """Unpin the step's slots; `updated` marks their rows dirty (written back on eviction
        and before a checkpoint)."""
        self.cache.release(pinned.cpu(), updated)

    @property
    def reads_rows(self) -> bool:
        return True

    @property
    def slot_rows(self) -> torch.Tensor | None:
        return self.cache.row_of

    def to_slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The cache slot of each local row id (same shape), and the distinct slots pinned."""
        self.file.release_pages()  # a checkpoint's, if any
        if self.gaps.pending is not None:  # the first step after a load
            self._fill_gaps()
        self.file.check_size("look up rows in")  # cut: its writes would regrow it over a hole
        try:
            id_slots, assignment = self.cache.assign_ids(ids.cpu())
        except CacheFull as full:
            raise CacheTooSmall(
                f"disk tier: table {self.config.name!r} on rank {self.rank} needs "
                f"{full.needed} distinct rows in its cache at once (this step's rows, with those "
                f"of a batch prefetched ahead if any), but the "
                f"cache holds {full.capacity} rows; raise DiskTier(cache_rows=...) to at least "
                f"{full.needed} (or cache_bytes=...), or use smaller batches"
            ) from None
        evicted = self._copy_out(assignment.evict_rows, assignment.evict_slots, ascending=True)
        if assignment.fetch_rows.numel():
            # before the victims' write: a write may drain the log the fetched rows are read from
            self._fetch(assignment.fetch_rows, assignment.fetch_slots, assignment.origins)
        if evicted is not None:
            self._write(*evicted)
        return id_slots.to(ids.device), assignment.slots.to(ids.device)

    def _copy_out(
        self, rows: torch.Tensor, slots: torch.Tensor, ascending: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Dirty victims' records copied out of the cache, by ascending row (their slots are
        reused at once; `ascending`: `rows` are in that order already); None if there are
        none."""
        if not rows.numel():
            return None
        if not ascending:
            rows, order = torch.sort(rows)
            slots = slots[order]
        records = self.file.empty(rows.numel())
        self.file.from_slots(records, slots.to(self.weight.device), self.weight, self.state)
        return rows, records

    def _write(self, rows: torch.Tensor, records: torch.Tensor, in_place: bool = False) -> None:
        """Records of uncached `rows` (ascending) appended to the write log in the background,
        or written to their places (in the background; now if `in_place`)."""
        if not in_place and self.log.append(rows, records):
            return
        self.log.settle()  # a chunk the background drain rewrites whole would undo these rows
        self.write_back.submit(rows, records)
        if in_place:
            self.write_back.settle()

    def _fetch(self, rows: torch.Tensor, slots: torch.Tensor, origins: torch.Tensor) -> None:
        device = self.weight.device
        # one C++ call: each record read straight into its slot (or copied from the batch in
        # flight); the torch path reads records, then copies them in
        never = self.write_back.fetch(rows, slots, origins, self.weight, self.state)
        if never is None:
            stored = origins != NEVER
            if bool(stored.any()):
                old, into, origin = rows[stored], slots[stored].to(device), origins[stored]
                at_place = origin == STORED
                records_at = torch.where(at_place, old, self.file.rows + log_record_of(origin))
                records = self.file.empty(old.numel())
                self.write_back.read(records_at, records)  # evicted a moment ago: from its batch
                self.file.to_slots(records, into, self.weight, self.state)
            never = torch.nonzero(~stored).flatten()
        if never.numel():
            new, into = rows[never], slots[never].to(device)
            table_rows, shard = new + self.shard.row_start, self.shard
            columns = (shard.col_start, shard.col_end)
            init_rows_into(self.config, self.seed, table_rows, columns, self.weight, into)
            for key, tensor in self.state.items():
                initial = self.initial[key].to(device).expand(new.numel(), *tensor.shape[1:])
                tensor.index_copy_(0, into, initial)

    # checkpoints --------------------------------------------------------------------------------
    @torch.no_grad()
    def flush(self) -> None:
        """Make the file hold the whole block: dirty cached rows written back, rows never
        written generated (before a checkpoint reads the file)."""
        self._fill_gaps()
        self._write_back()
        every: list[str | None] = [None, *self.state]
        for start in range(0, self.shard.rows, self.flush_rows):  # bounded: FLUSH_CHUNK_BYTES
            end = min(start + self.flush_rows, self.shard.rows)
            never = self.cache.never_written(start, end)
            if never.numel():
                self._write_initial(start, end, never, every)
                self.cache.mark_stored(start, end)
        self.gaps.flushed()  # no row is left never written

    def _write_back(self) -> None:
        """Dirty cached rows written to their places and the write log drained. A file cut
        short raises first: writing the rows back would regrow it over a hole, saved as zero
        rows."""
        self.file.check_size("write rows back to")
        rows, slots = self.cache.dirty_entries()
        for start in range(0, rows.numel(), self.flush_rows):  # a copy of a chunk at a time
            end = start + self.flush_rows
            dirty = self._copy_out(rows[start:end], slots[start:end])
            if dirty is not None:
                self._write(*dirty, in_place=True)
        self.log.drain("before a checkpoint")

    def _write_initial(
        self, start: int, end: int, rows: torch.Tensor, keys: Collection[str | None]
    ) -> None:
        """Fields `keys` (None: the weights) of `rows` (relative to `start`) of records
        [start, end) set to their initial values in the file; the others are kept."""
        shard = self.shard
        self.log.settle()  # the background drain's chunk in flight would undo this one
        records = self.file.read_range(start, end)
        if None in keys:
            values = init_rows(
                self.config,
                self.seed,
                (shard.row_start + start, shard.row_start + end),
                (shard.col_start, shard.col_end),
            )
            weights = self.file.weight_of(records)
            weights[rows] = values[rows].to(weights.dtype)
        for key in keys:
            if key is not None:
                state = self.file.state_of(records, key)
                state[rows] = self.initial[key].expand(rows.numel(), *state.shape[1:])
        self.file.write_range(start, records)

    @torch.no_grad()
    def _fill_gaps(self, unless: object | None = None) -> None:
        """The fields a load left in rows it found never written set to their initial values
        (load_gaps.py), a chunk at a time; not yet if `unless`, the load, is still writing."""
        taken = self.gaps.take(unless)
        if taken is None:
            return
        never, keys = taken
        for start in range(0, self.shard.rows, self.flush_rows):
            end = min(start + self.flush_rows, self.shard.rows)
            rows = torch.nonzero(never[start:end]).flatten()
            if rows.numel():
                self._write_initial(start, end, rows, keys)

    def checkpoint_chunks(self, key: str | None) -> list[tuple[int, torch.Tensor]]:
        """(first row, view) chunks of the weights (None) or a state tensor, views of the
        file's map after `flush`: a checkpoint copies one chunk at a time (a view of a larger
        storage is cloned before it is written), so memory stays about one chunk. For a load
        (loading()) the rows never written are left out of the flush: the load overwrites
        them (through `load_writer`, not the views), and `loaded` notes the fields it did not
        (load_gaps.py)."""
        load = current_load()
        if load is None:
            self.flush()
            self.load_writes.begin(None)  # every row was written: none is left as zeros
        else:
            self._hand_to(load)
        records = self.file.mapped()
        tensor = self.file.weight_of(records) if key is None else self.file.state_of(records, key)
        return [
            (start, tensor[start : start + self.checkpoint_rows])
            for start in range(0, self.shard.rows, self.checkpoint_rows)
        ]

    @property
    def spill_dir(self) -> Path | None:
        return self.directory

    def load_writer(
        self, key: str | None, start: int
    ) -> Callable[[Sequence[int], torch.Tensor], None]:
        """A load writes chunk `start` of `key` with pwrite (field_writes.py), not through
        the chunk's view of the map: a page's first write through the map cost 5-12x."""
        return functools.partial(self.load_writes.write, key, start)

    def drop_pages(self) -> None:
        """Before each checkpoint chunk: the last one's pages go, and a cut file is named here
        rather than met as SIGBUS in the chunk's read (or a load's write) of the map."""
        self.file.release_pages()
        self.file.check_size("map rows of")

    def _hand_to(self, load: object) -> None:
        """Before `load` gets views of the file: an earlier load's gaps filled, dirty cached
        rows written back (the fields it does not load keep them). The first time, its writes
        learn which rows still hold the reserved zeros (not read before they are patched)."""
        self._fill_gaps(unless=load)
        first = self.gaps.handing_to(load)
        self._write_back()
        if first:
            never = self.cache.slot_of == NEVER
            self.load_writes.begin(None if self.gaps.leftovers else never)

    def loaded(self, keys: Collection[str | None]) -> None:
        """A checkpoint load just wrote fields `keys` (None: the weights) of the whole block:
        drop the cache (the state_dict() the load wrote into wrote it back, so nothing is
        lost), and note which fields of the rows never written are still to be filled.
        Refused while rows are pinned: the batch holding them would look up its slots' old
        values."""
        if self.cache.pinned:
            raise CheckpointError(
                f"disk tier: table {self.config.name!r} (rank {self.rank}): a checkpoint was "
                f"loaded while {self.cache.pinned} cached rows are pinned by a batch in flight "
                "(read ahead by a pipeline, or a forward whose backward has not run), which "
                "would then use their old values; drop the batches in flight first "
                "(emb.drop_prefetched()) and load between steps"
            )
        load = current_load()
        self._fill_gaps(unless=load)  # another load's, if any
        if load is not None:  # else a flush made every row whole first
            self.gaps.loaded(load, keys, self.cache.slot_of == NEVER)
        self.log.forget()
        self.cache.drop_all()
        self.file.release_pages()
        self.load_writes.release()

    @torch.no_grad()
    def fill_from(self, source: torch.Tensor) -> None:
        """Start from a real (materialized) table's block, written in chunks."""
        self.log.drain("before a fill")  # a fresh table's log is empty: nothing to write
        self.gaps.take()  # every row is written below
        shard = self.shard
        for start in range(0, shard.rows, self.chunk_rows):
            end = min(start + self.chunk_rows, shard.rows)
            records = self.file.empty(end - start)
            self.file.weight_of(records).copy_(
                source[
                    shard.row_start + start : shard.row_start + end, shard.col_start : shard.col_end
                ]
            )
            for key in self.state:
                state = self.file.state_of(records, key)
                state.copy_(self.initial[key].expand(end - start, *state.shape[1:]))
            self.file.write_range(start, records)
        self.cache.mark_stored()


def hit_rate(tables: Iterable[DiskTable]) -> float:
    """The share of rows the steps found in the caches of `tables`, over their lifetime."""
    tables = list(tables)
    hits = sum(t.cache.hits for t in tables)
    misses = sum(t.cache.misses for t in tables)
    return hits / max(hits + misses, 1)
