"""A table's weight replaced by one of another shape or dtype stops the next step with an error.

The fused optimizer keeps each block's state (storage/table_blocks.py) one row per block row, in
the block's dtype: a weight replaced by another row count or dtype (`module.weight =
nn.Parameter(...)` of another shape, `emb.double()`) would leave it mismatched, and the step
would fail deep in a kernel or update rows with another row's state. A weight replaced by one of
the same shape and dtype (new values) is taken; the table batch then reads it again
(batched_tables.py: `replacements`). A disk tier's table (`cached`) takes none: its module's
weight is the row cache the tier fills from its file (and saves), which would go on using the
old one.

Each step's lookup checks each held block's weight by identity (a new Parameter, or new data
under the same one), about 0.1 us a table; shapes and dtypes only where one changed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.modules.bag_collection import table_weight
from manualpar.embeddings.storage.memory_rows import replaced_weight_error
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
        self._block: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for name in names:
            weight = table_weight(self.tables, name)
            self._seen.append((name, self.tables[name]._parameters, weight, weight.data_ptr()))
            self._block[name] = (weight.shape, weight.dtype)

    def check(self) -> None:
        """Raise BuilderError where a block's weight was replaced by another shape or dtype."""
        for k, (_, held, weight, data) in enumerate(self._seen):
            now = held.get("weight")  # None where not a registered parameter: `_replaced` reads
            if now is not weight or now.data_ptr() != data:
                self._replaced(k)

    def _replaced(self, k: int) -> None:
        name, held, weight, data = self._seen[k]
        now = table_weight(self.tables, name)
        if now is weight and now.data_ptr() == data:
            return
        shape, dtype = self._block[name]
        if name in self.cached:
            rows, cols = shape
            raise BuilderError(
                f"{BUILDER}: table {name!r} on rank {self.rank}: its weight was replaced, but the "
                f"table is on the disk tier: the weight is its row cache ({rows} x {cols} slots "
                "the tier fills from its file), so the step would look up slots of the new tensor "
                "the tier never fills, and checkpoints would save the old rows. Write new rows "
                "through a checkpoint load (the disk tier loads them into its file), or build the "
                f"collection again with {BUILDER}() from a collection holding the new rows"
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
