"""The planner's rule for managed-collision tables: their remappers' state comes first.

A remapper's buckets are split over every rank (sharded/managed_collisions.py), so each rank's
share of its state is taken off that rank's budget before any table is placed. A table placed
whole on one rank is remapped there and holds all its state on that rank: the planners add
what goes beyond the share there (ids/buckets.py, remapper_bytes_at_owner), and the other
ranks keep their share unused, so plans err on the safe side.
"""

from __future__ import annotations

from collections.abc import Iterable

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.ids.buckets import remapper_bytes_per_rank
from manualpar.embeddings.plan import format_bytes
from manualpar.errors import PlanError

__all__ = ["budget_after_remappers"]


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
