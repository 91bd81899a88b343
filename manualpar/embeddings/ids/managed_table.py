"""Managed collisions, one table: raw int64 ids given rows of their own as they arrive.

A table's rows are split into buckets of `bucket_rows` consecutive rows (the last one may be
shorter); a raw id hashes (raw_ids.hash_ids, with the table's salt) to bucket H mod buckets and
holds one row there. Per row the remapper keeps the raw id it holds, the step it was last seen
(0: the row is free) and how often it was seen. Each training step, for the distinct ids of the
step (with their occurrence counts):

- an id that holds a row keeps it (its step and count are updated);
- a new id takes, in its bucket, a free row if there is one, else the row of the id seen least
  recently ("lru": smallest last step) or least often ("lfu": smallest count, then last step),
  never a row seen this step. New ids of one bucket are served most frequent first, then by id
  (the order is the same whatever the batch order or the number of ranks). The evicted id's row
  keeps its values and optimizer state: the new id starts from them, as after a hash collision;
- a new id finding every row of its bucket seen this step (more distinct ids than rows), or
  any new id in eval mode (which changes nothing), shares a row picked by a second hash
  (mix64(H) mod the bucket's rows) without holding it.

Everything is per bucket, so a block of whole buckets is remapped alone with the numbers of the
whole table: the sharded remapper (sharded/managed_collisions.py) splits the buckets over the
ranks. Steps count the remapper's training forwards.

Stats, per table, since the last reset: ids/remap.py's STATS.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import count

import torch
from torch import nn

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.ids.buckets import STATE, layout_of, managed_setting
from manualpar.embeddings.ids.hashing import hash_ids, salt_key, unsigned_mod
from manualpar.embeddings.ids.remap import STATS
from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.kernels.splitmix import mix64

__all__ = ["NATIVE_BUCKET_ROWS", "ManagedCollisionTable"]

# The C++ remap scans an id's bucket for its row, so its cost grows with the bucket: one step
# of 10k distinct ids on a 100k-row table took 0.94 ms with 64-row buckets (the default), 2.9 ms
# with 1,024 and 4.3 ms with 2,048, against 10.7-11.5 ms on the torch path (one thread). Its
# packed keys hold a row's offset in 11 bits: larger buckets take the torch path.
NATIVE_BUCKET_ROWS = 2048


_BELOW_62 = (1 << 62) - 1
_BELOW_32 = (1 << 32) - 1
_NO_VERSION = count()  # keys of states without version counters, never equal


@dataclass(frozen=True)
class _HeldIndex:
    """Candidate rows of held ids: `ids` ascending with their `rows` (as of the last rebuild),
    `new_ids` ascending (stable: the newest entry of an id last) with `new_rows` (assigned
    since). `key` names the state it describes (ManagedCollisionTable._state_key)."""

    ids: torch.Tensor
    rows: torch.Tensor
    new_ids: torch.Tensor
    new_rows: torch.Tensor
    key: tuple[int, ...]


class ManagedCollisionTable(nn.Module):
    """One managed table's remapper state for the rows of buckets [first, end) (the whole table
    unsharded). Buffers: `ids`, `last_seen`, `counts` per row of the block, `step` (scalar)."""

    ids: torch.Tensor
    last_seen: torch.Tensor
    counts: torch.Tensor
    step: torch.Tensor

    def __init__(
        self,
        config: EmbeddingBagConfig,
        buckets: tuple[int, int] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config, self.layout = config, layout_of(config)
        self.buckets = buckets if buckets is not None else (0, self.layout.num_buckets)
        self.row_start, self.row_end = self.layout.row_range(self.buckets)
        rows = self.row_end - self.row_start
        for name in STATE:
            self.register_buffer(name, torch.zeros(rows, dtype=torch.int64, device=device))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        self.stats = dict.fromkeys(STATS, 0)
        self._index: _HeldIndex | None = None
        # False: always the torch path (the GPU's), for tests and benchmarks to compare with
        self.native = True

    def reset_parameters(self) -> None:
        """Every row free, no step taken (materialize() calls it on meta-built tables)."""
        for buffer in self.buffers():
            if not buffer.is_meta:
                buffer.zero_()

    def extra_repr(self) -> str:
        setting = managed_setting(self.config)
        return (
            f"{self.config.name!r}, policy={setting.policy!r}, buckets={self.buckets} of "
            f"{self.layout.num_buckets} ({setting.bucket_rows} rows)"
        )

    @torch.no_grad()
    def remap(self, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Table rows of distinct, ascending raw `ids` (as torch.unique returns them; all in
        this block's buckets) seen `counts` times this step; in training mode the step is
        taken: rows assigned, stats counted."""
        if self._native_takes(ids):
            return self._remap_native(ids, counts) + self.row_start
        local = self._held_rows(ids)
        if self.training:
            step = int(self.step) + 1
            self.step.fill_(step)
            hit = local >= 0
            held = local[hit]
            self.last_seen[held] = step
            self.counts[held] += counts[hit]
            new = torch.nonzero(~hit).flatten()
            if new.numel():
                new_ids = ids[new]
                bucket = self._local_buckets(new_ids)[1]
                local[new] = self._assign(new_ids, counts[new], bucket, step)
            self.stats["ids"] += ids.numel()
            self.stats["new"] += new.numel()
            if self._index is not None:  # our own writes keep the index valid
                self._index = replace(self._index, key=self._state_key())
        shared = torch.nonzero(local < 0).flatten()
        if shared.numel():
            local[shared] = self._shared_rows(*self._local_buckets(ids[shared]))
        return local + self.row_start

    def _native_takes(self, ids: torch.Tensor) -> bool:
        """The C++ remap (kernels/csrc/raw_ids.cpp): CPU tensors, buckets of at most
        NATIVE_BUCKET_ROWS rows."""
        return (
            self.native
            and self.layout.bucket_rows <= NATIVE_BUCKET_ROWS
            and native_kernels_take(ids, self.ids)
        )

    def remap_counted(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """`remap` for ids in any order with repeats (a repeat is the id seen again), position
        i seen counts[i] times (once without `counts`): a row per position."""
        if self._native_takes(ids):
            return self._remap_native(ids, counts) + self.row_start
        distinct, inverse = torch.unique(ids, return_inverse=True)
        if counts is None:
            summed = torch.bincount(inverse, minlength=distinct.numel())
        else:
            summed = torch.zeros_like(distinct).index_add_(0, inverse, counts)
        return self.remap(distinct, summed)[inverse]

    def _remap_native(self, ids: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """A step in one C++ pass (kernels/csrc/raw_ids.cpp), with the torch path's
        rows, state and stats bit for bit."""
        step = int(self.step) + 1 if self.training else 0
        setting = managed_setting(self.config)
        rows, stats = loaded_kernels().managed_remap(
            ids.to(torch.int64).contiguous(),
            None if counts is None else counts.to(torch.int64).contiguous(),
            self.ids,
            self.last_seen,
            self.counts,
            salt_key(setting.salt),
            self.layout.num_buckets,
            self.buckets[0],
            self.layout.bucket_rows,
            step,
            setting.policy == "lfu",
        )
        if self.training:
            self.step.fill_(step)
            self._index = None  # the state was written through its pointers, unversioned
            for key, value in zip(STATS, stats.tolist(), strict=True):
                self.stats[key] += value
        return rows

    def _local_buckets(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(H, bucket in this block) of `ids`; only for the ids that need them (new or shared,
        about a tenth of a step's ids in bench_raw_ids), as hashing is a dozen ops per id."""
        h = hash_ids(ids, managed_setting(self.config).salt)
        return h, unsigned_mod(h, self.layout.num_buckets) - self.buckets[0]

    def _bucket_rows(self, buckets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(len(buckets), bucket_rows) block rows of each local bucket, and which exist (the
        last bucket of a table may be shorter); rows past the end read the last row."""
        size = self.layout.bucket_rows
        rows = buckets.unsqueeze(1) * size + torch.arange(size, device=buckets.device)
        exists = rows < self.row_end - self.row_start
        return rows.clamp_(max=max(self.row_end - self.row_start - 1, 0)), exists

    def _held_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The block row holding each id, -1 if none does (an id is held at most once).

        Sorting the held ids every step was most of a remap (measured 1.3 ms of sort and copy
        for 44k held rows, 5k ids, one thread), so they stay sorted across steps: `_index`
        holds them as of its last rebuild plus the rows assigned since (sorted each step, a
        few thousand). An entry is a candidate: its row holds the id if the row's id is still
        that one (an indexed row is held until a reset or load, which rebuild the index: any
        change to the state from outside remap does)."""
        index = self._index
        if index is None or index.key != self._state_key():
            held_rows = torch.nonzero(self.last_seen).flatten()
            held, order = self.ids[held_rows].sort()
            none = held[:0]
            key = self._state_key()
            index = self._index = _HeldIndex(held, held_rows[order], none, none, key)
        out = self._search(index.ids, index.rows, ids, right=False)
        if index.new_ids.numel():
            # ids held since the rebuild: only those not found there (a tenth of them in
            # bench_raw_ids; a search costs about 35 ns per id, whatever the index's size)
            missed = torch.nonzero(out < 0).flatten()
            if missed.numel():
                found = self._search(index.new_ids, index.new_rows, ids[missed], right=True)
                out[missed] = found
        return out

    def _search(
        self, held: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, right: bool
    ) -> torch.Tensor:
        """The row of each id by its entry in `held` (ascending ids; `right`: the last entry of
        an id), -1 where the entry's row does not hold the id."""
        if not held.numel() or not ids.numel():
            return torch.full_like(ids, -1)
        at = torch.searchsorted(held, ids, right=right)
        at = (at - 1 if right else at).clamp_(0, held.numel() - 1)
        row = rows[at]
        return torch.where(self.ids[row] == ids, row, -1)

    def _remember_assigned(self, target: torch.Tensor, new_ids: torch.Tensor) -> None:
        """Rows `target` were just given `new_ids`: add them to the index (the newest entry of
        an id is searched first); rebuild once they are a quarter of the block."""
        index = self._index
        assert index is not None  # _held_rows ran first
        if index.new_ids.numel():
            new_ids, target = (
                torch.cat([index.new_ids, new_ids]),
                torch.cat([index.new_rows, target]),
            )
        if 4 * new_ids.numel() > self.last_seen.numel():
            self._index = None
            return
        added, order = new_ids.sort(stable=True)
        self._index = replace(index, new_ids=added, new_rows=target[order])

    def _state_key(self) -> tuple[int, ...]:
        """Which tensors hold the ids and steps, and their in-place version counters (tensors
        made under inference_mode have none: then a key that matches nothing, so the index is
        rebuilt every step)."""
        try:
            return tuple(
                x for t in (self.ids, self.last_seen) for x in (id(t), t.data_ptr(), t._version)
            )
        except RuntimeError:
            return (-1, next(_NO_VERSION))

    # _held_by_sort and _held_in_buckets: the two lookups _held_rows replaced (sort every
    # held id each step; compare each id with its bucket's rows), kept as its references in
    # the tests.
    def _held_by_sort(self, ids: torch.Tensor, held_rows: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(ids, -1)
        held, order = self.ids[held_rows].sort()
        at = torch.searchsorted(held, ids).clamp_(max=held.numel() - 1)
        hit = held[at] == ids
        out[hit] = held_rows[order[at[hit]]]
        return out

    def _held_in_buckets(self, ids: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
        rows, exists = self._bucket_rows(bucket)
        match = exists & (self.last_seen[rows] != 0) & (self.ids[rows] == ids.unsqueeze(1))
        at = match.to(torch.int8).argmax(1, keepdim=True)
        return torch.where(match.any(1), rows.gather(1, at).squeeze(1), -1)

    def _assign(
        self, ids: torch.Tensor, counts: torch.Tensor, bucket: torch.Tensor, step: int
    ) -> torch.Tensor:
        """Rows for new ids (-1 where their bucket has no row left this step); updates state.
        Only the buckets the new ids land in are sorted: sorting the whole block by the policy
        measured 5-7x slower on a 1M-row block (about the same on 50k rows) for 5k new ids."""
        touched, slot = torch.unique(bucket, return_inverse=True)
        rows, exists = self._bucket_rows(touched)
        last, seen = self.last_seen[rows], self.counts[rows]
        unusable = ~exists | (last == step)
        # each bucket's rows: usable ones by the policy (free rows first: their last step and
        # count are 0), then the others; stable sorts keep ties in row order. Keys pack the
        # criteria into one int64 (steps and counts below 2**62), one sort per criterion less.
        blocked = unusable.to(torch.int64) << 62
        if managed_setting(self.config).policy == "lfu":
            order = torch.argsort(last, dim=1, stable=True)
            key = (blocked + seen.clamp(max=_BELOW_62)).gather(1, order)
            order = order.gather(1, torch.argsort(key, dim=1, stable=True))
        else:
            order = torch.argsort(blocked + last, dim=1, stable=True)
        candidates = rows.gather(1, order)
        usable = (~unusable).sum(1)
        free = (exists & (last == 0)).sum(1)
        # new ids by bucket, most frequent first (counts saturate at 2**32 - 1), then by id
        # (they are ascending already): one packed key
        key = (slot << 32) + (_BELOW_32 - counts.clamp(max=_BELOW_32))
        by = torch.argsort(key, stable=True)
        sorted_slot = slot[by]
        per_slot = torch.bincount(slot, minlength=touched.numel())
        starts = torch.cumsum(per_slot, 0) - per_slot
        rank = torch.arange(by.numel(), device=ids.device) - starts[sorted_slot]
        placed = rank < usable[sorted_slot]
        target = candidates[sorted_slot[placed], rank[placed]]
        self.stats["collisions"] += int((rank >= free[sorted_slot]).sum())
        self.stats["evictions"] += int((self.last_seen[target] != 0).sum())
        chosen = by[placed]
        self.ids[target] = ids[chosen]
        self.last_seen[target] = step
        self.counts[target] = counts[chosen]
        self._remember_assigned(target, ids[chosen])
        out = torch.full_like(ids, -1)
        out[chosen] = target
        return out

    def _shared_rows(self, h: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
        """A row of the bucket by a second hash, for ids that hold none."""
        size = self.layout.bucket_rows
        first = bucket * size
        bucket_rows = (self.row_end - self.row_start - first).clamp(max=size)
        return first + unsigned_mod(mix64(h), bucket_rows)

    def take_stats(self, reset: bool) -> dict[str, int]:
        stats = dict(self.stats)
        if reset:
            self.stats = dict.fromkeys(STATS, 0)
        return stats
