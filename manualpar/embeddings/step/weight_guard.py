"""A table's weight replaced by another shape, dtype or device, or mid-step, stops with an error.

The fused optimizer keeps each block's state (storage/table_blocks.py) one row per block row, in
the block's dtype: a weight replaced by another row count or dtype (`module.weight =
nn.Parameter(...)` of another shape, `emb.double()`) would leave it mismatched, and the step
would fail deep in a kernel or update rows with another row's state. A weight replaced by one of
the same shape and dtype (new values) is taken; the table batch then reads it again
(batched_tables.py: `replacements`). A disk tier's table (`cached`) takes none: its module's
weight is the row cache the tier fills from its file (and saves), which would go on using the
old one.

A weight moved to another device (same shape and dtype: `emb.to(...)`, a new Parameter there)
is an error too, naming both devices: the block's optimizer state and the step's buffers stay on
the device the collection was built for. A weight replaced between a step's forward and its
backward is an error at that backward (`unchanged`), before any row is updated: the forward
looked up the old weight, so its update would land on a block the table no longer holds (the
table batch's) or on the new one from the old one's lookups (the per-table path's).

Each step's lookup checks each held block's weight by identity (a new Parameter, or new data
under the same one), about 0.1 us a table, and its update once more; shapes, dtypes and devices
only where one changed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.modules.bag_collection import table_weight
from manualpar.embeddings.storage.memory_rows import replaced_weight_error
from manualpar.embeddings.storage.replaced_cache import replaced_cache_error
from manualpar.errors import BuilderError

__all__ = ["WeightGuard"]


class WeightGuard:
    """The blocks' weights as the optimizer's state was made for them, checked each step."""

    def __init__(
        self,
        tables: nn.ModuleDict | None = None,
        names: Sequence[str] = (),
        rank: int = 0,
        replaced: Callable[[], None] | None = None,
        cached: Collection[str] = (),
    ) -> None:
        """`names`: the tables of the blocks held on this rank (job rank `rank`); none by
        default (a guard that checks nothing). `replaced` is called after each replacement
        taken (the fused optimizer's `weights_replaced`). `cached`: the tables whose weight is a
        row cache (RowStore.reads_rows), which refuse any replacement."""
        self.tables = nn.ModuleDict() if tables is None else tables
        self.rank = rank
        self.cached = frozenset(cached)
        self._on_replaced = replaced
        self.replacements = 0  # weights replaced (same shape and dtype) since the step was built
        # per block: (table, its module's parameters, the weight, where its data was)
        self._seen: list[tuple[str, dict[str, nn.Parameter | None], torch.Tensor, int]] = []
        self._block: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        for name in names:
            weight = table_weight(self.tables, name)
            self._seen.append((name, self.tables[name]._parameters, weight, weight.data_ptr()))
            self._block[name] = (weight.shape, weight.dtype, weight.device)

    def check(self) -> None:
        """Raise BuilderError where a block's weight has another shape, dtype or device."""
        for k, (_, held, weight, data) in enumerate(self._seen):
            now = held.get("weight")  # None where not a registered parameter: `_replaced` reads
            if now is not weight or now.data_ptr() != data:
                self._replaced(k)

    def unchanged(self, frozen: Collection[str] = ()) -> None:
        """At the start of a step's gradient exchange: raise BuilderError where the weight of a
        block it updates (not one of the step's `frozen` tables) was replaced since the step's
        lookup checked it (`check`). The caller (step/finite_check.py) carries the error on the
        non-finite flag, so every rank raises it before any row is updated."""
        for name, held, weight, data in self._seen:
            now = held.get("weight")  # None where not a registered parameter: read it there
            if (now is weight and now.data_ptr() == data) or name in frozen:
                continue
            current = table_weight(self.tables, name)
            if current is not weight or current.data_ptr() != data:
                raise BuilderError(
                    f"{BUILDER}: table {name!r} on rank {self.rank}: its weight was replaced "
                    "between this step's forward and its backward: the forward looked up the "
                    "old weight, so this backward would update a block the table no longer "
                    "holds, or the new weight with the old one's lookups. This backward updated "
                    "no row of this rank's tables; the next forward takes the new weight (or "
                    "refuses it, as any replacement). Replace a table's weight between steps "
                    "(after backward, before the next forward), and zero the dense gradients "
                    "this backward left"
                )

    def _replaced(self, k: int) -> None:
        name, held, weight, data = self._seen[k]
        now = table_weight(self.tables, name)
        if now is weight and now.data_ptr() == data:
            return
        shape, dtype, device = self._block[name]
        if name in self.cached:
            raise replaced_cache_error(name, self.rank, tuple(shape))
        if now.device != device:
            raise BuilderError(
                f"{BUILDER}: table {name!r} on rank {self.rank}: its weight was moved from "
                f"{device} to {now.device}, but this rank's block, its fused optimizer state and "
                f"the step's buffers are on {device}, the device the collection was built for. "
                f"Keep the table on {device} (move it back: `.to({str(device)!r})`), or build the "
                f"collection again with {BUILDER}() on a strategy of the new device"
            )
        if now.shape != shape or now.dtype != dtype:
            raise replaced_weight_error(
                f"{name!r} on rank {self.rank}",
                now,
                shape,
                dtype,
                " and the fused optimizer's state holds one row per block row in that dtype",
            )
        self._seen[k] = (name, held, now, now.data_ptr())
        self.replacements += 1
        if self._on_replaced is not None:
            self._on_replaced()
