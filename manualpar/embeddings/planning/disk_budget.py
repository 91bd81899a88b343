"""The planner's disk rule: when the tables do not fit the memory budget and a DiskTier is given,
the largest tables go on disk (rows split over every rank, each rank caching its block's rows
in use) until the rest, plus the caches, fit."""

from __future__ import annotations

from collections.abc import Mapping

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.plan import TablePlacement, format_bytes, on_disk, row_wise
from manualpar.embeddings.storage.disk_tier import DiskTier
from manualpar.errors import PlanError

__all__ = ["place_on_disk"]


def place_on_disk(
    tables: Mapping[str, EmbeddingBagConfig],
    sizes: Mapping[str, int],
    world_size: int,
    budget: int | None,
    disk_tier: DiskTier | None,
) -> tuple[dict[str, TablePlacement], dict[str, str], int | None]:
    """Placements and notes of the tables put on disk, and the budget left for the others."""
    if disk_tier is None or budget is None:
        return {}, {}, budget
    chosen: list[str] = []
    rest = dict(sizes)

    def cache_cost() -> int:
        if disk_tier.cache_bytes is not None:
            return disk_tier.cache_bytes if chosen else 0
        assert disk_tier.cache_rows is not None
        return sum(
            min(disk_tier.cache_rows, -(-tables[n].num_embeddings // world_size))
            * -(-sizes[n] // tables[n].num_embeddings)
            for n in chosen
        )

    def fits() -> bool:
        return -(-sum(rest.values()) // world_size) + cache_cost() <= budget

    for name in sorted(sizes, key=lambda k: sizes[k], reverse=True):
        if fits():
            break
        chosen.append(name)
        del rest[name]
    left = budget - cache_cost()
    if chosen and left < 0:
        raise PlanError(
            f"the disk tier's cache takes {format_bytes(cache_cost())} per rank, more than the "
            f"memory budget of {format_bytes(budget)}; give DiskTier a smaller cache_bytes= or "
            "cache_rows=, or raise the budget"
        )
    notes = {
        name: f"on disk: {format_bytes(sizes[name])} with the other tables exceed the "
        f"{format_bytes(budget)} budget per rank; rows split over all {world_size} ranks, "
        f"cached in memory"
        for name in chosen
    }
    return {name: on_disk(row_wise()) for name in chosen}, notes, left
