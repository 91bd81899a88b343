"""The errors when the tables do not fit: the budget against an even split of every table
(`check_fits`, before planning), and a table that fits no rank once others are placed
(`no_room`, during the search). Each says how much memory is needed and what to change."""

from __future__ import annotations

from collections.abc import Mapping

from manualpar.embeddings.plan import format_bytes
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.storage.cached_tier import CachedTier
from manualpar.errors import PlanError

__all__ = ["check_fits", "no_room"]


def check_fits(sizes: Mapping[str, int], world_size: int, budget: int | None) -> None:
    if budget is None:
        return
    need = -(-sum(sizes.values()) // world_size)
    if need > budget:
        raise PlanError(
            f"{_tables(sizes)} {format_bytes(sum(sizes.values()))} with optimizer state: at "
            f"least {format_bytes(need)} per rank on {world_size} ranks, more than the budget of "
            f"{format_bytes(budget)}; raise the memory budget to {format_bytes(need)} or more, use "
            f"{-(-sum(sizes.values()) // budget)} or more ranks, or shrink the tables"
        )


def _tables(sizes: Mapping[str, int]) -> str:
    """Who holds the bytes: the table by name, or how many tables and the largest."""
    largest = max(sizes, key=lambda name: sizes[name])
    if len(sizes) == 1:
        return f"table {largest!r} holds"
    return f"the {len(sizes)} tables (largest {largest!r}: {format_bytes(sizes[largest])}) hold"


def no_room(
    name: str,
    size: int,
    total: RankCosts,
    budget: int | None,
    world: int,
    disk_tier: CachedTier | None,
) -> PlanError:
    low, high = float(total.memory.min()), float(total.memory.max())
    held = (
        f"{format_bytes(low)} each"
        if low == high
        else f"{format_bytes(low)} to {format_bytes(high)}"
    )
    share = -(-size // world)
    fix = "" if disk_tier is not None else ", or give a DiskTier (disk_tier=) to keep it on disk"
    return PlanError(
        f"table {name!r} ({format_bytes(size)} with optimizer state) fits no rank: split "
        f"over all {world} ranks it needs {format_bytes(share)} each, but ranks already hold "
        f"{held} of a {format_bytes(budget or 0)} budget. Raise the memory budget, add ranks, "
        f"or shrink the tables{fix}"
    )
