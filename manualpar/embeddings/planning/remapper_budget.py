"""The planner's rule for managed-collision tables: their remappers' state comes first.

A remapper's buckets are split over every rank (the remap exchange,
sharded/managed_collisions.py), so each rank's share of its state is taken off that rank's
budget before any table is placed. A table placed
whole on one rank is remapped there and holds all its state on that rank: the planners add
what goes beyond the share there (ids/buckets.py, remapper_bytes_at_owner), and the other
ranks keep their share unused, so plans err on the safe side.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.ids.buckets import (
    REMAPPER_ROW_BYTES,
    layout_of,
    managed_tables,
    owner_blocks,
    remapper_bytes_per_rank,
)
from manualpar.embeddings.plan import EmbeddingPlan, format_bytes
from manualpar.errors import PlanError

__all__ = ["budget_after_remappers", "remapper_bytes_on_ranks"]


def budget_after_remappers(
    tables: Iterable[EmbeddingBagConfig], world_size: int, budget: int | None
) -> int | None:
    """The budget left for the tables once every rank holds its share of the managed-collision
    remappers' state."""
    remappers = remapper_bytes_per_rank(list(tables), world_size)
    if budget is None or not remappers:
        return budget
    if remappers >= budget:
        raise PlanError(
            f"the managed-collision remappers' state takes {format_bytes(remappers)} per rank "
            f"on {world_size} ranks (3 int64 per row of the ManagedCollisions tables), the "
            f"whole budget of {format_bytes(budget)}; raise the memory budget, use more ranks, "
            "or give those tables fewer rows"
        )
    return budget - remappers


def remapper_bytes_on_ranks(plan: EmbeddingPlan, tables: Sequence[EmbeddingBagConfig]) -> list[int]:
    """The remappers' state each rank holds under a 1-D `plan`, exactly: a table remapped at
    its owners (owner_blocks) on the ranks of its blocks, in whole buckets; the others'
    buckets split evenly over every rank (the sharded remapper splits them by the same rule)."""
    rows = [0] * plan.world_size
    for config in managed_tables(tables):
        layout = layout_of(config)
        if blocks := owner_blocks(config, plan):
            for rank, buckets in blocks.items():
                first, end = layout.row_range(buckets)
                rows[rank] += end - first
        else:
            for rank in range(plan.world_size):
                first, end = layout.row_range(layout.owned(rank, plan.world_size))
                rows[rank] += end - first
    return [count * REMAPPER_ROW_BYTES for count in rows]
