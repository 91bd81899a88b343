"""`plan_collections`: plan="auto" for several collections together.

It plans the tables of every collection of a model at once, through plan_tables' stages
(planner.py), so the ranks balance over all of them; collections planned one by one each start
from empty ranks and pile their largest tables onto the same ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from torch.distributed.device_mesh import DeviceMesh

from manualpar import deprecated
from manualpar.embeddings.config import EmbeddingBagConfig, check_tables
from manualpar.embeddings.kernels.row_memory import agreed_available_bytes
from manualpar.embeddings.modules.bag_collection import EmbeddingBagCollection
from manualpar.embeddings.modules.sequence_collection import EmbeddingCollection
from manualpar.embeddings.optim.update_rules import UpdateRule
from manualpar.embeddings.plan import EmbeddingPlan, format_bytes
from manualpar.embeddings.planning.constraints import (
    PlanConstraints,
    PlanOptions,
    refuse_dtypes,
    resolve,
)
from manualpar.embeddings.planning.disk_budget import check_tier_layout
from manualpar.embeddings.planning.memory_planner import table_bytes
from manualpar.embeddings.planning.planner import Pricing, place, planned
from manualpar.errors import PlanError
from manualpar.strategy import ManualParallelStrategy

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from manualpar.embeddings.planning.constraints import CollectionKeywords

Collection = EmbeddingBagCollection | EmbeddingCollection | Sequence[EmbeddingBagConfig]

__all__ = ["plan_collections"]


def plan_collections(
    collections: Mapping[str, Collection],
    world: int | ManualParallelStrategy,
    constraints: PlanConstraints | None = None,
    options: PlanOptions | None = None,
    *,
    rule: UpdateRule | Mapping[str, UpdateRule] | None = None,
    optimizer: UpdateRule | Mapping[str, UpdateRule] | None = None,
    pooling_factors: Mapping[str, Mapping[str, float]] | None = None,
    mesh: DeviceMesh | None = None,
    **keywords: Unpack[CollectionKeywords],
) -> dict[str, EmbeddingPlan]:
    """One plan per collection, made together: plan="auto"'s rules applied to the tables of all
    `collections` at once, so memory and lookups balance over every table of the model (planned
    one at a time, two towers of three equal tables each put two tables on rank 0).

    `collections`: name -> EmbeddingBagCollection (meta or real) or its list of configs.
    `world`: the world size, or the strategy; with the strategy, `ranks_per_node` defaults to
    the node's ranks and, without `memory_budget_bytes`, the budget is the memory every rank can
    still allocate, as shard_embeddings(plan="auto") (a collective then: call it on every rank).
    `mesh` (with the strategy): the shard dim of a 2-D mesh, e.g. `mesh["shard"]`; the plans are
    then for its ranks, and `ranks_per_node` defaults to those of its ranks on one node.
    `rule` (the update rule whose state is counted; `optimizer=` before 0.3, with a warning)
    and `pooling_factors` ({table: mean ids per bag}) are one for all, or given per collection
    name (or one for all in `options`). `price`, `topology`
    and `batch_per_rank` as for `plan_tables` (with the strategy, the default topology follows
    its device). Hand each plan to `shard_embeddings(ebc, strategy, plan=plans[name], ...)`.
    With several collections, notes and errors name a table "collection.table", and so does
    `pinned` ({table: placement} kept as given, as for `plan_tables`). `constraints`, `options`
    and the keywords as for plan_tables.
    """
    rules_given = cast(  # (a union with a Mapping: mypy joins the TypeVar to object)
        "UpdateRule | Mapping[str, UpdateRule] | None",
        deprecated.renamed_keyword("plan_collections(optimizer=...)", rule, optimizer, "rule="),
    )
    limits, priced = resolve("plan_collections()", constraints, options, keywords)
    refuse_dtypes("plan_collections()", limits)
    ranks_per_node, memory_budget_bytes = priced.ranks_per_node, limits.memory_budget_bytes
    configs = _collection_configs(collections)
    if mesh is not None and not isinstance(world, ManualParallelStrategy):
        raise PlanError("plan_collections(mesh=...): pass the strategy as `world` with a mesh")
    if isinstance(world, ManualParallelStrategy):
        world_size = world.world_size if mesh is None else world.group_size(mesh)
        ranks_per_node = ranks_per_node or _ranks_per_node(world, mesh)
        measured = memory_budget_bytes is None
        budget = agreed_available_bytes(world) if measured else memory_budget_bytes
    elif isinstance(world, int) and not isinstance(world, bool):
        world_size, budget, measured = world, memory_budget_bytes, False
    else:
        raise PlanError(
            f"plan_collections(): world must be the world size (an int) or the strategy, got "
            f"{type(world).__name__}"
        )
    if world_size < 1:
        raise PlanError(f"plan_collections(): the world size must be >= 1, got {world_size}")
    check_tier_layout(limits.disk_tier, _replicas(world, world_size))  # before the budget's note
    rules = _per_collection(rules_given or priced.rule, configs, "rule", UpdateRule)
    shared = (
        None if priced.pooling_factors is None else dict.fromkeys(configs, priced.pooling_factors)
    )
    pooling = _per_collection(pooling_factors or shared, configs, "pooling_factors", None)
    several = len(configs) > 1
    labels = {
        (c, t.name): f"{c}.{t.name}" if several else t.name
        for c, tables in configs.items()
        for t in tables
    }
    try:
        placements, notes, wires = place(
            {labels[c, t.name]: t for c, tables in configs.items() for t in tables},
            {labels[c, t.name]: table_bytes(t, rules[c]) for c, ts in configs.items() for t in ts},
            {
                labels[c, t.name]: float((pooling[c] or {}).get(t.name, 1.0))
                for c, ts in configs.items()
                for t in ts
            },
            world_size,
            dataclasses.replace(limits, memory_budget_bytes=budget),
            Pricing(
                dataclasses.replace(
                    priced,
                    ranks_per_node=ranks_per_node or world_size,
                    replicas=_replicas(world, world_size),
                    rule=None,
                ),
                {labels[c, t.name]: rules[c] for c, ts in configs.items() for t in ts},
                world.device.type if isinstance(world, ManualParallelStrategy) else "cpu",
                world.environment.local_world_size
                if isinstance(world, ManualParallelStrategy)
                else None,
                collection_of={labels[c, t.name]: c for c, ts in configs.items() for t in ts},
            ),
        )
    except PlanError as error:
        if not measured:
            raise
        raise PlanError(
            f"{error} (the budget is the memory each rank can allocate now, "
            f"{format_bytes(budget or 0)}; pass memory_budget_bytes= to plan for another amount)"
        ) from None
    return {
        c: planned(
            world_size,
            {t.name: placements[labels[c, t.name]] for t in tables},
            {t.name: notes[labels[c, t.name]] for t in tables},
            wires.get(c),
        )
        for c, tables in configs.items()
    }


def _replicas(world: int | ManualParallelStrategy, plan_size: int) -> int:
    """Shard groups in the job: 1 unless the plan is for one dim of a 2-D mesh."""
    if isinstance(world, ManualParallelStrategy):
        return world.world_size // plan_size
    return 1


def _ranks_per_node(strategy: ManualParallelStrategy, mesh: DeviceMesh | None) -> int:
    """The launcher's processes per node, or how many ranks of the 1-D `mesh` share this
    rank's node (ranks are numbered node by node)."""
    per_node = strategy.environment.local_world_size
    if mesh is None:
        return per_node
    members = mesh.mesh.flatten().tolist()
    return sum(1 for r in members if r // per_node == strategy.rank // per_node)


def _collection_configs(
    collections: Mapping[str, Collection],
) -> dict[str, tuple[EmbeddingBagConfig, ...]]:
    """Each collection's table configs, checked as an EmbeddingBagCollection checks them."""
    if not isinstance(collections, Mapping) or not collections:
        got = type(collections).__name__ if not isinstance(collections, Mapping) else "{}"
        raise PlanError(
            "plan_collections() takes a non-empty mapping name -> EmbeddingBagCollection, e.g. "
            f"{{'user': model.user_tables, 'item': model.item_tables}}; got {got}"
        )
    configs = {}
    for name, collection in collections.items():
        if not isinstance(name, str) or not name:
            raise PlanError(f"plan_collections(): collection names must be strings, got {name!r}")
        if isinstance(collection, (EmbeddingBagCollection, EmbeddingCollection)):
            configs[name] = collection.configs
        elif isinstance(collection, Sequence) and all(
            isinstance(c, EmbeddingBagConfig) for c in collection
        ):
            check_tables(collection)
            configs[name] = tuple(collection)
        else:
            raise PlanError(
                f"plan_collections(): collection {name!r} is a {type(collection).__name__}; pass "
                "the EmbeddingBagCollection or EmbeddingCollection (before shard_embeddings) or "
                "its list of EmbeddingBagConfig"
            )
    return configs


def _per_collection(
    value: Any, configs: Mapping[str, object], what: str, single: type | None
) -> dict[str, Any]:
    """`value` for every collection: one shared value, or a mapping by collection name (which
    must name existing collections). `single`: the type of a shared value (None: never shared)."""
    if value is None or (single is not None and isinstance(value, single)):
        return dict.fromkeys(configs, value)
    if not isinstance(value, Mapping):
        raise PlanError(
            f"plan_collections(): {what} must be "
            + (f"a {single.__name__} or " if single is not None else "")
            + f"a mapping collection name -> value, got {type(value).__name__}"
        )
    unknown = sorted(set(value) - set(configs))
    if unknown:
        raise PlanError(
            f"plan_collections(): {what} names collections {unknown} that were not given; the "
            f"collections are {list(configs)}"
        )
    return {name: value.get(name) for name in configs}
