"""The planner's disk rule and pinned tables.

The rule: when the tables do not fit the memory budget and a DiskTier is given, the largest
tables go on disk, in order (rows split over every rank, each rank caching its block's rows in
use), until the rest, plus the caches, fit. Both methods apply it before placing anything, so a
table that fits in memory alone never pushes a larger one's cache over the budget.

Pinned tables (`plan_tables(..., pinned={"big": row_wise(on_disk=True)})`) keep the placement the
user gave; the rule and the planner place the others around them, counting their memory (a
pinned disk table's cache) against the budget.
"""

from __future__ import annotations

from collections.abc import Mapping

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.plan import (
    EmbeddingPlan,
    TablePlacement,
    format_bytes,
    row_wise,
)
from manualpar.embeddings.storage.cached_tier import CachedTier
from manualpar.errors import PlanError

__all__ = [
    "check_pinned",
    "check_tier_layout",
    "pinned_bytes_per_rank",
    "pinned_notes",
    "place_on_disk",
]


def check_pinned(
    pinned: Mapping[str, TablePlacement] | None,
    tables: Mapping[str, EmbeddingBagConfig],
    world_size: int,
    disk_tier: CachedTier | None,
) -> dict[str, TablePlacement]:
    """`pinned`, checked before any planning: known tables, placements on existing ranks, and a
    disk tier for those pinned on disk."""
    pinned = dict(pinned or {})
    unknown = sorted(set(pinned) - set(tables))
    if unknown:
        raise PlanError(
            f"pinned= names tables {unknown} that are not planned; the tables are {list(tables)}"
            " (with several collections, name them 'collection.table')"
        )
    for key, placement in pinned.items():
        if not isinstance(placement, TablePlacement):
            raise PlanError(
                f"pinned[{key!r}] must be a placement such as row_wise(), table_wise(rank) or "
                f"row_wise(on_disk=True), got {type(placement).__name__}"
            )
        _check_placement(key, tables[key], placement, world_size)
    disk = sorted(key for key, placement in pinned.items() if placement.on_disk)
    if disk and disk_tier is None:
        raise PlanError(
            f"pinned= puts tables {disk} on disk, but no disk tier was given; pass "
            "disk_tier=DiskTier(directory, cache_bytes=...)"
        )
    return pinned


def _check_placement(
    key: str, config: EmbeddingBagConfig, placement: TablePlacement, world_size: int
) -> None:
    """A pinned placement's checks, as a plan's, naming the table as the planner does."""
    try:
        EmbeddingPlan(world_size, {config.name: placement}).validate([config], world_size)
    except PlanError as error:
        if key == config.name:
            raise
        raise PlanError(f"pinned[{key!r}]: {error}") from None


def check_tier_layout(disk_tier: CachedTier | None, replicas: int) -> None:
    """The disk tier is for a 1-D layout: refused first on a 2-D mesh, before any budget check
    could fail for a reason the user cannot act on."""
    if disk_tier is not None and replicas > 1:
        raise PlanError(
            f"the disk tier does not support a 2-D mesh ({replicas} replicated shard groups): "
            "the replicas' summed gradients update rows the other replicas looked up, which a "
            "rank's cache holds no slots for; plan for a 1-D mesh to keep tables on disk, or "
            "drop disk_tier= and keep them in memory"
        )


def pinned_bytes_per_rank(
    tables: Mapping[str, EmbeddingBagConfig],
    sizes: Mapping[str, int],
    pinned: Mapping[str, TablePlacement],
    world_size: int,
) -> list[int]:
    """What the tables pinned in memory hold on each rank (weights + state, by block area)."""
    held = [0] * world_size
    memory = {k: p for k, p in pinned.items() if not p.on_disk}
    for key, placement in memory.items():
        config = tables[key]
        area = config.num_embeddings * config.embedding_dim
        for shard in EmbeddingPlan(world_size, {config.name: placement}).shards(config):
            held[shard.rank] += -(-sizes[key] * shard.rows * shard.cols // area)
    return held


def place_on_disk(
    tables: Mapping[str, EmbeddingBagConfig],
    sizes: Mapping[str, int],
    world_size: int,
    budget: int | None,
    disk_tier: CachedTier | None,
    pinned: Mapping[str, TablePlacement] | None = None,
) -> tuple[dict[str, TablePlacement], dict[str, str], int | None]:
    """Placements and notes of the tables the rule puts on disk, and the budget left for the
    tables not on disk (the caches taken off)."""
    pinned = pinned or {}
    if disk_tier is None or budget is None:
        return {}, {}, budget
    chosen: list[str] = [k for k, p in pinned.items() if p.on_disk]
    rest = {k: b for k, b in sizes.items() if k not in chosen}  # pins in memory: an even share

    def cache_cost() -> int:  # what the tier's cache takes on a rank (storage/cached_tier.py)
        return disk_tier.cache_memory(
            {
                n: (
                    -(-tables[n].num_embeddings // _blocks(n, pinned, world_size)),
                    -(-sizes[n] // tables[n].num_embeddings),
                )
                for n in chosen
            }
        )

    def fits() -> bool:
        return -(-sum(rest.values()) // world_size) + cache_cost() <= budget

    movable = [k for k in rest if k not in pinned]
    for name in sorted(movable, key=lambda k: sizes[k], reverse=True):
        if fits():
            break
        chosen.append(name)
        del rest[name]
    left = budget - cache_cost()
    if chosen and left < 0:
        rows = sum(-(-tables[n].num_embeddings // _blocks(n, pinned, world_size)) for n in chosen)
        raise PlanError(
            f"the disk tier's cache of tables {chosen} takes {format_bytes(cache_cost())} per "
            f"rank (the rows it caches, and its bookkeeping, which grows with the {rows} block "
            f"rows a rank holds), more than the memory budget of {format_bytes(budget)}; give "
            "DiskTier a smaller cache_bytes= or cache_rows=, use more ranks, or raise the budget"
        )
    moved = [name for name in chosen if name not in pinned]
    notes = {
        name: f"on disk: {format_bytes(sizes[name])} with the other tables exceed the "
        f"{format_bytes(budget)} budget per rank; rows split over all {world_size} ranks, "
        f"cached in memory"
        for name in moved
    }
    return {name: row_wise(on_disk=True) for name in moved}, notes, left


def pinned_notes(pinned: Mapping[str, TablePlacement]) -> dict[str, str]:
    return {key: f"pinned: {placement}" for key, placement in pinned.items()}


def _blocks(name: str, pinned: Mapping[str, TablePlacement], world_size: int) -> int:
    """How many ranks share a disk table's rows (every rank unless pinned otherwise)."""
    placement = pinned.get(name)
    if placement is None or placement.sharding == "column_wise":
        return world_size if placement is None else 1
    return len(placement.resolved_ranks(world_size))
