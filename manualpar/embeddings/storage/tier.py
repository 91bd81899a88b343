"""The storage-tier interface: where one table block's rows live on this rank.

A sharded step addresses a block by *slots*: rows of the tensors the lookup reads and the fused
update writes (the module's weight and the optimizer's state). In memory a slot is the row
itself; the disk tier (disk_tier.py) maps each step's rows to slots of a bounded cache, fetching
and evicting as it goes. The step and the fused optimizer talk to every block through
`RowStore` and never ask which tier it is; a new tier (a GPU cache over host memory, say) is one
class implementing it.

A step: `begin_step()` on every block; `to_slots(ids)` once the ids reach their owner (the
slots returned stay valid, *pinned*, until `release`); the lookup and the update run on the
slot tensors; `release(pinned, updated)` when the update is done (or the step failed).
Checkpoints read and write the block through `checkpoint_chunks` (a load through
`load_writer` where a store has one), and `loaded()` follows a load.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["Pins", "RowStore", "TableStores"]

Pins = list[tuple[int, torch.Tensor]]  # (table index, pinned slots) held by one step


class RowStore(Protocol):
    """One table block on this rank, as the step and the fused optimizer see it."""

    def begin_step(self) -> None:
        """A new step starts (cache policies count steps)."""

    def to_slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The slot of each block-local row id (same shape), and the slots pinned for this step
        (None when nothing needs releasing)."""

    def release(self, pinned: torch.Tensor, updated: bool) -> None:
        """Unpin a step's slots; `updated`: their rows were written (a store may write back)."""

    @property
    def reads_rows(self) -> bool:
        """Whether `to_slots` reads rows in (a bounded cache over a file): a pipeline's
        prefetch then runs it a step early, so the rows are in before their step."""

    @property
    def slot_rows(self) -> torch.Tensor | None:
        """The block row each slot holds, or None when slot i is row i (stochastic rounding
        draws by row, so the bits do not depend on the tier)."""

    def checkpoint_chunks(self, key: str | None) -> list[tuple[int, torch.Tensor]]:
        """(first row, rows) chunks of the whole block's weights (None) or optimizer state
        `key`, in row order: what a checkpoint saves, and where a load writes."""

    def load_writer(
        self, key: str | None, start: int
    ) -> Callable[[Sequence[int], torch.Tensor], None] | None:
        """How a load writes into the chunk of `key` starting at row `start` (the Block's
        `write` hook: offsets within the chunk, values), or None: into the chunk's tensor."""

    def loaded(self, keys: Collection[str | None]) -> None:
        """A checkpoint load just wrote the chunks of `keys` (as in `checkpoint_chunks`): drop
        anything derived from the old rows."""

    @property
    def spill_dir(self) -> Path | None:
        """Where a background save stages its private copy of this block's chunks (a disk
        tier's directory: the copy must not undo the tier's memory bound), or None: in
        memory."""

    def drop_pages(self) -> None:
        """Let go of the memory reading or writing earlier checkpoint chunks took (a disk
        tier's mapped file pages; the data stays in the file): called before each chunk."""


class TableStores:
    """The RowStore of each table block this rank holds, by table index (and by name)."""

    def __init__(self, stores: Mapping[int, RowStore], names: Mapping[int, str]) -> None:
        self.stores = dict(stores)
        self.by_name = {names[t]: store for t, store in self.stores.items()}

    def begin_step(self) -> None:
        for store in self.stores.values():
            store.begin_step()

    @property
    def reads_rows(self) -> bool:
        """Whether any block reads its rows in when ids become slots (RowStore.reads_rows)."""
        return any(store.reads_rows for store in self.stores.values())

    def to_slots(self, local: list[Any], bags: list[Any], pins: Pins) -> list[Any]:
        """One sender's bags for this rank's routed `local` shards, with row ids replaced by
        slots; appends the slots pinned to `pins`. A failure unpins the step's earlier pins (no
        backward will)."""
        mapped = []
        for shard, (ids, lengths, weights) in zip(local, bags, strict=True):
            try:
                slots, pinned = self.stores[shard.table].to_slots(ids)
            except Exception:
                self.release(pins, updated=False)
                raise
            if pinned is not None:
                pins.append((shard.table, pinned))
            mapped.append((slots, lengths, weights))
        return mapped

    def release(self, pins: Pins, updated: bool) -> None:
        for t, slots in pins:
            self.stores[t].release(slots, updated)
        pins.clear()
