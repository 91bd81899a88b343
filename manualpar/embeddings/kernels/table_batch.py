"""Table batches: the bags of many tables looked up, grouped and updated in one kernel call each.

A rank may hold dozens of small tables (a CTR model's 26 sparse features); one lookup, one
grouping and one update call per table then cost more than their rows. A `TableBatch` lays every
table's bags end to end (the step's order: sender, then table) and the C++ kernels
(csrc/table_batch.cpp) walk them in one call, each table kept in its own tensors. Per bag and per
row the arithmetic is the one-table path's, in the same order (the same bits). Only where
`native_kernels_take` holds: the per-table path is the pure-torch one, and stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manualpar.embeddings.kernels.bags import RowGroups, ShardBags
from manualpar.embeddings.kernels.native import loaded_kernels

__all__ = ["BATCHED_DTYPES", "Segments", "TableBatch", "group_batch", "pool_tables"]

# the dtypes the batched kernels take (half rows keep their per-table kernels and rounding)
BATCHED_DTYPES = (torch.float32, torch.float64)


class Segments:
    """(table, first bag, end bag, output, first element, row stride) rows, built in order:
    each run of consecutive bags of one table, and where its pooled rows go (`output`: an
    index into `pool_tables`' outs)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.bags = 0

    def add(self, table: int, bags: int, out: int = 0, offset: int = 0, stride: int = 0) -> None:
        self.rows += (table, self.bags, self.bags + bags, out, offset, stride)
        self.bags += bags

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.rows, dtype=torch.int64).view(-1, 6)


@dataclass
class TableBatch:
    """Every sender's bags of this rank's tables, one after the other in (sender, table)
    order, as one ShardBags over one row space: table k's rows are keys
    [row_offsets[k], row_offsets[k + 1]) of `bags.groups`."""

    bags: ShardBags
    segments: torch.Tensor  # (n, 6): the table of each run of bags (Segments)
    row_offsets: torch.Tensor  # (tables + 1,) int64
    counts: list[list[int]]  # per sender, per table: its bags

    def table_ids(self, table: int) -> torch.Tensor:
        """The row ids of one table's bags, every sender's (what an undo copy saves)."""
        starts = torch.zeros(self.bags.lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(self.bags.lengths, 0, out=starts[1:])
        parts = [
            self.bags.ids[starts[int(s[1])] : starts[int(s[2])]]
            for s in self.segments.tolist()
            if s[0] == table
        ]
        return torch.cat(parts) if parts else self.bags.ids[:0]


def pool_tables(
    weights: list[torch.Tensor],
    ids: torch.Tensor,
    lengths: torch.Tensor,
    segments: torch.Tensor,
    outs: list[torch.Tensor],
    assign: bool = False,
) -> None:
    """Add each bag's sum of rows into its segment's place in `outs` (one call, all tables);
    `assign`: write it there instead (the bits of adding it into zeros, with no zeros written
    first; the segments' places must not overlap)."""
    loaded_kernels().pool_tables(weights, ids, lengths, segments, outs, assign)


def group_batch(batch: TableBatch) -> None:
    """Group the batch's ids by row over all its tables at once (batch.bags.groups): keys
    row_offsets[table] + id, so runs of one table are adjacent and in the per-table order.
    One kernel pass makes each id's key as it sorts (no keys tensor, no second pass)."""
    bags = batch.bags
    bags.groups = RowGroups(
        *loaded_kernels().group_tables(
            bags.ids, bags.lengths, batch.segments, batch.row_offsets, bags.own_begin, bags.own_end
        )
    )
