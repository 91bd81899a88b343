"""Plans from table sizes: `plan_tables` (plan="auto"), `plan_collections` (plan="auto" for
several collections together) and `plan_uniform` (one placement kind).

plan="auto" places by predicted step time (method="cost", the default: cost_planner.py, with
the cost model of cost_model.py on a Topology); method="memory" keeps the earlier placement by
size, lookups and a per-rank memory budget (memory_planner.py).

`plan_collections` plans the tables of every collection of a model at once, so
the ranks balance over all of them; collections planned one by one each start from empty ranks
and pile their largest tables onto the same ranks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from manualpar.embeddings.config import (
    EmbeddingBagConfig,
    check_tables,
)
from manualpar.embeddings.kernels.row_memory import agreed_available_bytes
from manualpar.embeddings.modules.bag_collection import EmbeddingBagCollection
from manualpar.embeddings.modules.sequence_collection import EmbeddingCollection
from manualpar.embeddings.optim.update_rules import SparseOptimizer
from manualpar.embeddings.plan import (
    EmbeddingPlan,
    TablePlacement,
    format_bytes,
    row_wise,
)
from manualpar.embeddings.planning.cost_planner import COST_REPLICATE_BYTES, plan_by_cost
from manualpar.embeddings.planning.disk_budget import (
    check_pinned,
    check_tier_layout,
    place_on_disk,
)
from manualpar.embeddings.planning.memory_planner import (
    REPLICATE_BYTES,
    UNIFORM_PLANS,
    check_fits,
    place_by_memory,
    plan_uniform,
    table_bytes,
)
from manualpar.embeddings.planning.rank_costs import Workload, rule_costs, sequence_padding
from manualpar.embeddings.planning.remapper_budget import budget_after_remappers
from manualpar.embeddings.planning.topology import Topology, load_topology
from manualpar.embeddings.storage.disk_tier import DiskTier
from manualpar.errors import PlanError
from manualpar.strategy import ManualParallelStrategy

Collection = EmbeddingBagCollection | EmbeddingCollection | Sequence[EmbeddingBagConfig]

__all__ = [
    "METHODS",
    "UNIFORM_PLANS",
    "default_topology",
    "plan_collections",
    "plan_tables",
    "plan_uniform",
    "table_bytes",
]

GiB = 2**30
METHODS = ("cost", "memory")
DEFAULT_BATCH_PER_RANK = 1024  # samples a rank per step, when the caller does not say
_IN_MEMORY = row_wise()  # what a table neither pinned nor put on disk counts as


def default_topology(
    world_size: int, ranks_per_node: int | None = None, device_type: str = "cpu"
) -> Topology:
    """The topology a plan assumes when none is given: for CPU jobs the measured CPU host with
    this machine's cores, for GPU jobs an A100 node (datasheet numbers); pass your own
    (`load_topology`) to plan for another machine."""
    if device_type != "cpu":
        return load_topology("a100-nvlink-hdr", world_size, ranks_per_node)
    measured = load_topology("cpu-host", world_size, ranks_per_node)
    return dataclasses.replace(measured, cores_per_node=os.cpu_count() or 1)  # this host's


def plan_tables(
    tables: Sequence[EmbeddingBagConfig],
    world_size: int,
    *,
    ranks_per_node: int | None = None,
    memory_budget_bytes: int | None = None,
    optimizer: SparseOptimizer | None = None,
    pooling_factors: Mapping[str, float] | None = None,
    replicate_bytes: int | None = None,
    disk_tier: DiskTier | None = None,
    method: str = "cost",
    topology: Topology | None = None,
    batch_per_rank: int | None = None,
    replicas: int = 1,
    skew: float = 0.0,
    pinned: Mapping[str, TablePlacement] | None = None,
) -> EmbeddingPlan:
    """A plan for `tables` on `world_size` ranks; see the module docstring. With method="cost",
    `topology` (default: default_topology) prices the plan for `batch_per_rank` samples a rank
    and `pooling_factors` ({table: mean ids per bag}) ids a sample, drawn uniformly or with
    Zipf(`skew`) popularity. `replicas` > 1: the plan is for the shard dim (`world_size` ranks)
    of a replicas x world_size mesh. `replicate_bytes`: the largest table (weights + state) that
    may be replicated; by default 64 MiB for method="cost", whose model weighs the gradient
    all_reduce against the exchanges saved, and 256 KiB for method="memory". `pinned`:
    {table: placement} kept as given (e.g. `on_disk(row_wise())`, with `disk_tier`), the
    others planned around them with their memory counted."""
    placements, notes = _place(
        {c.name: c for c in tables},
        {c.name: table_bytes(c, optimizer) for c in tables},
        {c.name: float((pooling_factors or {}).get(c.name, 1.0)) for c in tables},
        world_size,
        ranks_per_node or world_size,
        memory_budget_bytes,
        replicate_bytes,
        disk_tier,
        _Cost(method, topology, batch_per_rank, optimizer, replicas=replicas, skew=skew),
        pinned,
    )
    return EmbeddingPlan(world_size, placements, notes)


def plan_collections(
    collections: Mapping[str, Collection],
    world: int | ManualParallelStrategy,
    *,
    ranks_per_node: int | None = None,
    memory_budget_bytes: int | None = None,
    optimizer: SparseOptimizer | Mapping[str, SparseOptimizer] | None = None,
    pooling_factors: Mapping[str, Mapping[str, float]] | None = None,
    replicate_bytes: int | None = None,
    mesh: DeviceMesh | None = None,
    disk_tier: DiskTier | None = None,
    method: str = "cost",
    topology: Topology | None = None,
    batch_per_rank: int | None = None,
    pinned: Mapping[str, TablePlacement] | None = None,
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
    `optimizer` (whose state is counted) and `pooling_factors` ({table: mean ids per bag}) are
    one for all, or given per collection name. `method`, `topology` and `batch_per_rank` as for
    `plan_tables` (with the strategy, the default topology follows its device). Hand each plan to
    `shard_embeddings(ebc, strategy, plan=plans[name], optimizer=...)`. With several
    collections, notes and errors name a table "collection.table", and so does `pinned`
    ({table: placement} kept as given, as for `plan_tables`).
    """
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
    check_tier_layout(disk_tier, _replicas(world, world_size))  # before the budget's note
    rules = _per_collection(optimizer, configs, "optimizer", SparseOptimizer)
    pooling = _per_collection(pooling_factors, configs, "pooling_factors", None)
    several = len(configs) > 1
    labels = {
        (c, t.name): f"{c}.{t.name}" if several else t.name
        for c, tables in configs.items()
        for t in tables
    }
    try:
        placements, notes = _place(
            {labels[c, t.name]: t for c, tables in configs.items() for t in tables},
            {labels[c, t.name]: table_bytes(t, rules[c]) for c, ts in configs.items() for t in ts},
            {
                labels[c, t.name]: float((pooling[c] or {}).get(t.name, 1.0))
                for c, ts in configs.items()
                for t in ts
            },
            world_size,
            ranks_per_node or world_size,
            budget,
            replicate_bytes,
            disk_tier,
            _Cost(
                method,
                topology,
                batch_per_rank,
                None,
                {labels[c, t.name]: rules[c] for c, ts in configs.items() for t in ts},
                world.device.type if isinstance(world, ManualParallelStrategy) else "cpu",
                _replicas(world, world_size),
                world.environment.local_world_size
                if isinstance(world, ManualParallelStrategy)
                else None,
                collection_of={labels[c, t.name]: c for c, ts in configs.items() for t in ts},
            ),
            pinned,
        )
    except PlanError as error:
        if not measured:
            raise
        raise PlanError(
            f"{error} (the budget is the memory each rank can allocate now, "
            f"{format_bytes(budget or 0)}; pass memory_budget_bytes= to plan for another amount)"
        ) from None
    return {
        c: EmbeddingPlan(
            world_size,
            {t.name: placements[labels[c, t.name]] for t in tables},
            {t.name: notes[labels[c, t.name]] for t in tables},
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


def _place(
    tables: Mapping[str, EmbeddingBagConfig],
    sizes: Mapping[str, int],
    pooling: Mapping[str, float],
    world_size: int,
    ranks_per_node: int,
    budget: int | None,
    replicate_bytes: int | None,
    disk_tier: DiskTier | None,
    cost: _Cost,
    pinned: Mapping[str, TablePlacement] | None = None,
) -> tuple[dict[str, TablePlacement], dict[str, str]]:
    """Placements and notes by the module docstring's rules, keyed (and named in errors) by the
    keys of `tables`, in their order; `pinned` tables keep their placement."""
    if cost.method not in METHODS:
        raise PlanError(f"plan method must be one of {METHODS}, got {cost.method!r}")
    check_tier_layout(disk_tier, cost.replicas)  # before any budget error
    pinned = check_pinned(pinned, tables, world_size, disk_tier)
    net = budget_after_remappers(tables.values(), world_size, budget)  # (its error first)
    if cost.method == "memory":
        replicate = REPLICATE_BYTES if replicate_bytes is None else replicate_bytes
        return place_by_memory(
            tables, sizes, pooling, world_size, ranks_per_node, net, replicate, disk_tier, pinned
        )
    # the documented disk rule first: the largest tables on disk until the rest fits
    disk, disk_notes, left = place_on_disk(tables, sizes, world_size, net, disk_tier, pinned)
    fixed = {**pinned, **disk}
    check_fits(
        {k: b for k, b in sizes.items() if not fixed.get(k, _IN_MEMORY).on_disk}, world_size, left
    )
    planned = plan_by_cost(
        tables,
        cost.topology_for(world_size, ranks_per_node),
        cost.workload(tables, pooling),
        memory_budget_bytes=budget,
        replicate_bytes=COST_REPLICATE_BYTES if replicate_bytes is None else replicate_bytes,
        disk_tier=disk_tier,
        replicas=cost.replicas,
        pinned=fixed,
    )
    notes = {**planned.plan.notes, **disk_notes}
    return dict(planned.plan.tables), {key: notes[key] for key in tables}


@dataclass(frozen=True)
class _Cost:
    """How plan_tables/plan_collections were asked to price plans (method="cost")."""

    method: str
    topology: Topology | None
    batch_per_rank: int | None
    optimizer: SparseOptimizer | None
    rules: Mapping[str, SparseOptimizer | None] = field(default_factory=dict)
    device_type: str = "cpu"
    replicas: int = 1  # shard groups of a 2-D mesh (the plan is for one)
    job_ranks_per_node: int | None = None  # the launcher's, when the plan is for a mesh dim
    skew: float = 0.0  # Zipf exponent of the ids
    collection_of: Mapping[str, str] = field(default_factory=dict)  # table key -> collection

    def topology_for(self, world_size: int, ranks_per_node: int) -> Topology:
        """The whole job's topology (`world_size` ranks per shard group, `replicas` groups)."""
        world = world_size * self.replicas
        per_node = self.job_ranks_per_node or ranks_per_node
        if self.topology is None:
            return default_topology(world, per_node, self.device_type)
        if self.topology.world_size != world:
            return self.topology.with_world(world, per_node)
        return self.topology

    def workload(
        self, tables: Mapping[str, EmbeddingBagConfig], pooling: Mapping[str, float]
    ) -> Workload:
        state, full_rows = rule_costs(self.optimizer)
        return Workload(
            batch_per_rank=self.batch_per_rank or DEFAULT_BATCH_PER_RANK,
            ids_per_bag=dict(pooling),
            state=state,
            full_rows=full_rows,
            rules={name: rule_costs(self.rules.get(name, self.optimizer)) for name in tables},
            skew=self.skew,
            padded_ids=sequence_padding(tables, pooling, self.collection_of),
        )
