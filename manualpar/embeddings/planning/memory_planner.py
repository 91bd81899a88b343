"""Plans by memory alone: method="memory" of plan_tables / plan_collections, and plan_uniform
(one placement kind for every table). The rules of method="memory", in order (each table's note
says which applied):
1. A table of at most `replicate_bytes` (weights + state) is replicated (data_parallel): its
   lookups need no communication, and its all-reduce is small.
2. Tables go whole to one rank (table_wise: the cheapest communication, one pooled row per bag)
   largest first, each to the rank with the least estimated load, where load mixes memory and
   lookup work (pooling factor x dim).
3. A table that fits no rank's remaining budget, or is larger than an even share of all tables
   (it would leave one rank the straggler), is split by rows over every rank (row_wise), or
   over one node's ranks (table_row_wise) when that fits, keeping its traffic on the node.
4. If even an even split cannot fit the budget, PlanError says how much memory is needed.
0. Before these, tables `pinned` to a placement keep it (their memory counted); then, with a
   `disk_tier`, when the tables do not fit the budget, the largest go on disk (row-split,
   `on_disk`), in order, until the others plus the caches fit (disk_budget.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from manualpar import deprecated
from manualpar.embeddings.config import ROW_WISE_STATE, EmbeddingBagConfig, block_bytes
from manualpar.embeddings.id_spaces import ManagedCollisions
from manualpar.embeddings.ids.buckets import remapper_bytes_at_owner
from manualpar.embeddings.optim.update_rules import UpdateRule
from manualpar.embeddings.plan import (
    EmbeddingPlan,
    TablePlacement,
    column_wise,
    data_parallel,
    format_bytes,
    row_wise,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.planning.disk_budget import (
    pinned_bytes_per_rank,
    pinned_notes,
    place_on_disk,
)
from manualpar.embeddings.planning.fit_errors import check_fits
from manualpar.embeddings.planning.remapper_budget import remapper_bytes_on_ranks
from manualpar.embeddings.row_blocks import largest_row_block
from manualpar.embeddings.storage.cached_tier import CachedTier
from manualpar.errors import PlanError

REPLICATE_BYTES = 256 * 2**10  # tables up to this size (with state) are replicated

__all__ = [
    "REPLICATE_BYTES",
    "UNIFORM_PLANS",
    "place_by_memory",
    "plan_uniform",
    "table_bytes",
]


def table_bytes(config: EmbeddingBagConfig, rule: UpdateRule | None = None) -> int:
    """A whole table's weights plus the update rule's state (row-wise Adagrad's if none given)."""
    state = rule.STATE if rule is not None else ROW_WISE_STATE
    return block_bytes(config.num_embeddings, config.embedding_dim, state, config.dtype)


def place_by_memory(
    tables: Mapping[str, EmbeddingBagConfig],
    sizes: Mapping[str, int],
    pooling: Mapping[str, float],
    world_size: int,
    ranks_per_node: int,
    budget: int | None,
    replicate_bytes: int,
    disk_tier: CachedTier | None,
    pinned: Mapping[str, TablePlacement] | None = None,
) -> tuple[dict[str, TablePlacement], dict[str, str]]:
    """method="memory": the rules of the module docstring, around the `pinned` tables."""
    order, pinned = list(tables), dict(pinned or {})
    on_disk, disk_notes, budget = place_on_disk(
        tables, sizes, world_size, budget, disk_tier, pinned
    )
    memory = pinned_bytes_per_rank(tables, sizes, pinned, world_size)
    fixed = {**pinned, **on_disk}
    check_fits(
        {k: b for k, b in sizes.items() if not fixed.get(k, row_wise()).on_disk},
        world_size,
        budget,
    )
    tables = {k: c for k, c in tables.items() if k not in fixed}
    sizes = {k: b for k, b in sizes.items() if k not in fixed}
    work = [0.0] * world_size
    total_work = sum(pooling[k] * c.embedding_dim * len(c.feature_names) for k, c in tables.items())
    placements: dict[str, TablePlacement] = {}
    notes: dict[str, str] = {}
    even_share = sum(sizes.values()) / world_size

    def load(rank: int) -> float:
        return memory[rank] / max(even_share, 1) + work[rank] / max(total_work, 1)

    for name in sorted(tables, key=lambda k: sizes[k], reverse=True):
        config, size = tables[name], sizes[name]
        lookups = pooling[name] * config.embedding_dim * len(config.feature_names)
        if (
            size <= replicate_bytes
            and (budget is None or max(memory) + size <= budget)
            and world_size > 1
        ):
            placements[name] = data_parallel()
            notes[name] = f"replicated: {format_bytes(size)} <= {format_bytes(replicate_bytes)}"
            memory = [m + size for m in memory]
            continue
        # whole on a rank, a managed table's remapper state is all there too
        whole = size + remapper_bytes_at_owner(config, world_size)
        fits = [r for r in range(world_size) if budget is None or memory[r] + whole <= budget]
        too_big = world_size > 1 and size > even_share * 1.0001
        if fits and not too_big:
            rank = min(fits, key=load)
            placements[name] = table_wise(rank)
            notes[name] = f"whole on rank {rank} ({format_bytes(size)}; least-loaded rank)"
            memory[rank] += whole
            work[rank] += lookups
            continue
        reason = "fits no single rank's budget" if not fits else "larger than an even share"
        nodes = world_size // ranks_per_node
        node_share = -(-size // ranks_per_node) + _owned_remapper(
            config, world_size, ranks_per_node
        )
        if nodes > 1:
            node = min(
                range(nodes),
                key=lambda n: max(memory[n * ranks_per_node : (n + 1) * ranks_per_node]),
            )
            node_ranks = range(node * ranks_per_node, (node + 1) * ranks_per_node)
            if budget is None or all(memory[r] + node_share <= budget for r in node_ranks):
                placements[name] = table_row_wise(node, ranks_per_node)
                notes[name] = f"rows split over node {node} ({reason})"
                for r in node_ranks:
                    memory[r] += node_share
                    work[r] += lookups / ranks_per_node
                continue
        share = -(-size // world_size) + _owned_remapper(config, world_size, world_size)
        if budget is not None and any(m + share > budget for m in memory):
            held = [format_bytes(m) for m in memory]
            least = format_bytes(-(-sum(sizes.values()) // world_size))
            raise PlanError(
                f"table {name!r} needs {format_bytes(share)} per rank split over {world_size} "
                f"ranks, but ranks already hold {held} of a {format_bytes(budget)} budget; all "
                f"tables need at least {least} per rank. Raise the memory budget, add ranks, or "
                "shrink the tables"
            )
        placements[name] = row_wise()
        notes[name] = (
            f"rows split over all {world_size} ranks ({reason}; {format_bytes(share)} each)"
        )
        memory = [m + share for m in memory]
        work = [w + lookups / world_size for w in work]
    placements.update(fixed)
    notes.update(disk_notes | pinned_notes(pinned))
    return {k: placements[k] for k in order}, {k: notes[k] for k in order}


def _owned_remapper(config: EmbeddingBagConfig, world_size: int, parts: int) -> int:
    """What the owners of a managed table's `parts` row blocks hold of its remapper beyond the
    share counted on every rank (each remaps its block, ids/buckets.py)."""
    if not isinstance(config.raw_ids, ManagedCollisions):
        return 0
    return remapper_bytes_at_owner(config, world_size, largest_row_block(config, parts))


# plan_uniform(kind, ...) and `python -m manualpar plan --plan KIND`: one kind for all tables.
UNIFORM_PLANS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


def plan_uniform(
    sharding: str,
    tables: Sequence[EmbeddingBagConfig],
    world_size: int,
    *,
    ranks_per_node: int | None = None,
    memory_budget_bytes: int | None = None,
    rule: UpdateRule | None = None,
    optimizer: UpdateRule | None = None,
) -> EmbeddingPlan:
    """Every table placed the same way: table_wise and table_row_wise put the largest tables
    first on the least-loaded rank (node); the others split every table over all ranks.

    Unlike `plan_tables`, the placement does not adapt to the budget: a rank it overflows
    (weights, optimizer state and the managed-collision remappers' state it holds) raises
    PlanError naming the rank. `rule`: the update rule whose state is counted (`optimizer=`
    before 0.3, with a warning).
    """
    rule = deprecated.renamed_keyword("plan_uniform(optimizer=...)", rule, optimizer, "rule=")
    if sharding not in UNIFORM_PLANS:
        raise PlanError(f"sharding must be one of {UNIFORM_PLANS}, got {sharding!r}")
    per_node = ranks_per_node or world_size
    if sharding == "table_wise":
        placements = _least_loaded(tables, world_size, rule, table_wise)
    elif sharding == "table_row_wise":
        placements = _least_loaded(
            tables, world_size // per_node, rule, lambda node: table_row_wise(node, per_node)
        )
    else:
        make: Callable[[], TablePlacement] = {
            "row_wise": row_wise,
            "data_parallel": data_parallel,
            "column_wise": lambda: column_wise(range(world_size)),
        }[sharding]
        placements = {c.name: make() for c in tables}
    plan = EmbeddingPlan(world_size, placements)
    plan.validate(tables, world_size)
    state = rule.STATE if rule is not None else ROW_WISE_STATE
    remappers = remapper_bytes_on_ranks(plan, tables)
    tables_bytes = plan.bytes_per_rank(tables, state)
    per_rank = [size + held for size, held in zip(tables_bytes, remappers, strict=True)]
    budget = memory_budget_bytes
    over = [rank for rank, size in enumerate(per_rank) if budget is not None and size > budget]
    if over:
        rank = max(over, key=lambda r: per_rank[r])
        of_which = (
            f" ({format_bytes(remappers[rank])} of it the managed-collision remappers' state)"
            if remappers[rank]
            else ""
        )
        raise PlanError(
            f"plan {sharding} puts {format_bytes(per_rank[rank])} on rank {rank}{of_which}, more "
            f"than the memory budget of {format_bytes(budget or 0)}; try plan 'auto', more ranks "
            "or a larger budget"
        )
    return plan


def _least_loaded(
    tables: Sequence[EmbeddingBagConfig],
    bins: int,
    rule: UpdateRule | None,
    place: Callable[[int], TablePlacement],
) -> dict[str, TablePlacement]:
    """Largest table first, each to the bin (rank or node) with the fewest bytes so far."""
    load, placements = [0] * bins, {}
    for config in sorted(tables, key=lambda c: table_bytes(c, rule), reverse=True):
        target = load.index(min(load))
        placements[config.name] = place(target)
        load[target] += table_bytes(config, rule)
    return {c.name: placements[c.name] for c in tables}
