"""RowCache: which rows of a disk-tier block sit in which slot of its in-memory cache.

Bookkeeping only (no row data): the disk tier (disk_tier.py) moves the rows. `slot_of` says
where each row is: its slot, NEVER, STORED (at its place in the file) or LOGGED - record (in the
file's write log, write_log.py). A step's rows are
*pinned* from its forward to its backward, so nothing it looks up is evicted before its update.
Victims are the unpinned slots with the smallest key:

- "lru": the step the row was last used;
- "lfu": how many steps used it while cached, ties broken by the last use;
- "lrfu": the step it was last used, plus LRFU_REACH steps for each step that used it while
  cached, up to LRFU_USES of them: a row used often stays longer than one used once, but not
  for ever (LFU's counts keep yesterday's hot rows once the hot rows shift).

Victims are chosen in batches (at least 1/16 of the cache, once the free slots run out), so the
selection over all slots runs every few steps, not every step. Ties go to the lower slot, and
victims are freed in slot order, so the C++ pass (kernels/csrc/row_cache.cpp, `assign_ids`)
and the torch path leave the same state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.errors import ConfigError

__all__ = [
    "EVICT_FRACTION",
    "LOGGED",
    "LRFU_REACH",
    "LRFU_USES",
    "NEVER",
    "POLICIES",
    "ROW_INDEX_BYTES",
    "SLOT_INDEX_BYTES",
    "STORED",
    "CacheFull",
    "RowCache",
    "SlotAssignment",
    "index_bytes",
    "log_record_of",
]

POLICIES = ("lru", "lfu", "lrfu")  # the C++ pass takes their index
LRFU_REACH = 16  # steps of lasting a use adds to an "lrfu" key
LRFU_USES = 8  # uses counted, at most
NEVER = -1  # slot_of value: never written, its values are the table's initial ones
STORED = -2  # slot_of value: not cached, its values are in the file at the row's own place
LOGGED = -3  # slot_of values <= LOGGED: not cached, at write-log record LOGGED - value
_UNAVAILABLE = torch.iinfo(torch.int64).max


def log_record_of(codes: torch.Tensor) -> torch.Tensor:
    """The write-log records (int64) that `slot_of` codes <= LOGGED name."""
    return LOGGED - codes.to(torch.int64)


EVICT_FRACTION = 16

# The bookkeeping RowCache.__init__ allocates beside the slots' rows, which the planner counts
# with them (DiskTier.cache_memory): `slot_of` (int32) for each of the block's rows, and
# `row_of`, `last_used`, `uses`, `free_slots` (int64), `pins` (int32) and `dirty` (bool) for
# each slot. At the documented workload (74M rows and 7.8M slots a rank) that is 297 MB + 288 MB.
ROW_INDEX_BYTES = 4
SLOT_INDEX_BYTES = 4 * 8 + 4 + 1


def index_bytes(rows: int, slots: int) -> int:
    """Bytes of a RowCache's bookkeeping for a block of `rows` rows cached in `slots` slots (the
    slots' rows themselves not included)."""
    return rows * ROW_INDEX_BYTES + slots * SLOT_INDEX_BYTES


class CacheFull(Exception):
    """The rows pinned at once would not fit the cache (`needed` slots of `capacity`)."""

    def __init__(self, needed: int, capacity: int) -> None:
        super().__init__(f"{needed} rows needed at once, cache of {capacity}")
        self.needed, self.capacity = needed, capacity


@dataclass
class SlotAssignment:
    """The slot of each requested row, and the IO to do first: write `evict_rows` back from
    `evict_slots` (dirty rows only, by ascending row), then read `fetch_rows` into
    `fetch_slots` from where `origins` says (their `slot_of` values before: NEVER rows are
    generated)."""

    slots: torch.Tensor
    evict_rows: torch.Tensor
    evict_slots: torch.Tensor
    fetch_rows: torch.Tensor
    fetch_slots: torch.Tensor
    origins: torch.Tensor


class RowCache:
    def __init__(self, num_rows: int, capacity: int, policy: str = "lru") -> None:
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.num_rows, self.capacity, self.policy = num_rows, capacity, policy
        self.slot_of = torch.full((num_rows,), NEVER, dtype=torch.int32)
        self.row_of = torch.full((capacity,), -1, dtype=torch.int64)
        self.pins = torch.zeros(capacity, dtype=torch.int32)
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.last_used = torch.zeros(capacity, dtype=torch.int64)
        self.uses = torch.zeros(capacity, dtype=torch.int64)
        # a stack: free_slots[:free_count], popped from the end (slot 0 first)
        self.free_slots = torch.arange(capacity - 1, -1, -1)
        self.free_count = capacity
        self.step = 0
        self.hits = self.misses = self.evictions = 0
        self.native = True  # False: the torch path, even where the C++ kernels are built

    @property
    def free(self) -> torch.Tensor:
        return self.free_slots[: self.free_count]

    def new_step(self) -> None:
        self.step += 1

    def assign_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, SlotAssignment]:
        """`assign` for one call's ids (CPU int64, repeats allowed): the slot of each id, and
        the assignment of their distinct rows. One C++ pass where the kernels are built."""
        if not (self.native and native_kernels_take(ids)):
            rows, inverse = torch.unique(ids, return_inverse=True)
            assignment = self.assign(rows)
            return assignment.slots[inverse], assignment
        result = loaded_kernels().cache_assign(
            ids.contiguous(),
            self.slot_of,
            self.row_of,
            self.pins,
            self.dirty,
            self.last_used,
            self.uses,
            self.free_slots,
            self.free_count,
            self.step,
            POLICIES.index(self.policy),
            LRFU_REACH,
            LRFU_USES,
            self.capacity // EVICT_FRACTION,
        )
        counts = result[-1].tolist()
        if counts[0] < 0:
            raise CacheFull(counts[1], self.capacity)
        id_slots, pinned, fetch_rows, fetch_slots, origins, evict_rows, evict_slots, _ = result
        self.free_count = counts[0]
        self.hits += counts[1]
        self.misses += counts[2]
        self.evictions += counts[3]
        assignment = SlotAssignment(
            pinned, evict_rows, evict_slots, fetch_rows, fetch_slots, origins
        )
        return id_slots, assignment

    def assign(self, rows: torch.Tensor) -> SlotAssignment:
        """Pin distinct `rows` (int64) into slots, choosing victims if the free slots run out.
        Raises CacheFull, leaving the cache as it was, if the pinned rows would not fit."""
        slots = self.slot_of[rows].to(torch.int64)
        missing = slots < 0
        miss_rows = rows[missing]
        hit_slots = slots[~missing]
        self.pins[hit_slots] += 1
        short = miss_rows.numel() - self.free_count
        evict_rows = evict_slots = rows[:0]
        if short > 0:
            try:
                evict_rows, evict_slots = self._evict(short, miss_rows.numel())
            except CacheFull:
                self.pins[hit_slots] -= 1
                raise
        count = miss_rows.numel()
        new_slots = self.free_slots[self.free_count - count : self.free_count].flip(0)
        self.free_count -= count
        origins = self.slot_of[miss_rows]
        self.slot_of[miss_rows] = new_slots.to(torch.int32)
        self.row_of[new_slots] = miss_rows
        # generated rows are not in the file yet; a logged row's record is dropped from the log
        # once read (logged rows are always written again, so the log holds no clean row)
        self.dirty[new_slots] = origins != STORED
        self.pins[new_slots] += 1
        self.uses[new_slots] = 0
        slots[missing] = new_slots
        self._touch(slots)
        self.hits += hit_slots.numel()
        self.misses += count
        return SlotAssignment(slots, evict_rows, evict_slots, miss_rows, new_slots, origins)

    def _evict(self, short: int, missing: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Free at least `short` slots (a batch of 1/16 of the cache where possible); returns
        the dirty victims (rows, slots) to write back, by ascending row."""
        key = self._keys()
        unavailable = (self.pins > 0) | (self.row_of < 0)
        key[unavailable] = _UNAVAILABLE
        available = self.capacity - int(unavailable.sum())
        if available < short:
            pinned = int((self.pins > 0).sum())
            raise CacheFull(pinned + missing, self.capacity)
        count = min(available, max(short, self.capacity // EVICT_FRACTION))
        # the smallest keys, ties to the lower slot (a stable sort), freed in slot order
        victims = torch.sort(key, stable=True).indices[:count].sort().values
        self.evictions += count
        rows = self.row_of[victims]
        self.slot_of[rows] = STORED  # dirty ones are written back (to their place or the log)
        self.row_of[victims] = -1
        dirty = self.dirty[victims]
        self.dirty[victims] = False
        # under the free slots left: taken after them, in ascending order
        left = self.free_slots[: self.free_count].clone()
        self.free_slots[count : count + self.free_count] = left
        self.free_slots[:count] = victims.flip(0)
        self.free_count += count
        rows, order = torch.sort(rows[dirty])
        return rows, victims[dirty][order]

    def _keys(self) -> torch.Tensor:
        """Each slot's eviction key (a fresh tensor): the smallest go first."""
        if self.policy == "lfu":
            return self.uses * 2**32 + self.last_used
        if self.policy == "lrfu":
            return self.last_used + LRFU_REACH * self.uses.clamp(max=LRFU_USES)
        return self.last_used.clone()

    def _touch(self, slots: torch.Tensor) -> None:
        fresh = slots[self.last_used[slots] != self.step]
        self.uses[fresh] += 1
        self.last_used[slots] = self.step

    def release(self, slots: torch.Tensor, updated: bool) -> None:
        """Unpin `slots` (one assign's); `updated`: their rows changed (write them back later)."""
        if self.native and native_kernels_take(slots):
            loaded_kernels().cache_release(slots.contiguous(), self.pins, self.dirty, updated)
            return
        self.pins[slots] -= 1
        if updated:
            self.dirty[slots] = True

    def dirty_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, slots) of the cached rows that differ from the file; marks them clean."""
        slots = torch.nonzero(self.dirty).flatten()
        self.dirty[slots] = False
        return self.row_of[slots], slots

    def never_written(self, start: int, end: int) -> torch.Tensor:
        """Rows in [start, end) never written (not cached, not in the file), relative to start."""
        return torch.nonzero(self.slot_of[start:end] == NEVER).flatten()

    def logged_rows(
        self, start: int = 0, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, write-log records) of the rows in [start, end) whose values are in the write
        log, by row."""
        rows = torch.nonzero(self.slot_of[start:end] <= LOGGED).flatten() + start
        return rows, log_record_of(self.slot_of[rows])

    def mark_logged(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Uncached `rows` now live at write-log `records`."""
        self.slot_of[rows] = (LOGGED - records).to(torch.int32)

    def mark_stored(self, start: int = 0, end: int | None = None) -> None:
        """Rows in [start, end) never written are now in the file at their place."""
        part = self.slot_of[start:end]
        part[part == NEVER] = STORED

    def mark_drained(self, rows: torch.Tensor) -> None:
        """Logged `rows` were written to their place."""
        self.slot_of[rows] = STORED

    def drop_all(self) -> None:
        """Forget every cached row without writing it back: the file was replaced (a loaded
        checkpoint); every row is now in the file."""
        self.slot_of.fill_(STORED)
        self.row_of.fill_(-1)
        self.pins.zero_()
        self.dirty.zero_()
        self.uses.zero_()
        self.free_slots = torch.arange(self.capacity - 1, -1, -1)
        self.free_count = self.capacity

    @property
    def pinned(self) -> int:
        return int((self.pins > 0).sum())
