"""Plans from table sizes: `plan_tables` (plan="auto"), `plan_collections` (plan="auto" for
several collections together) and `plan_uniform` (one placement kind).

plan="auto" places by predicted step time (method="cost", the default: cost_planner.py, with
the cost model of cost_model.py on a Topology). method="memory" keeps the earlier placement by
size, lookups and a per-rank memory budget, whose rules, in order (each table's note says which
applied), are:
1. A table of at most `replicate_bytes` (weights + state) is replicated (data_parallel): its
   lookups need no communication, and its all-reduce is small.
2. Tables go whole to one rank (table_wise: the cheapest communication, one pooled row per bag)
   largest first, each to the rank with the least estimated load, where load mixes memory and
   lookup work (pooling factor x dim).
3. A table that fits no rank's remaining budget, or is larger than an even share of all tables
   (it would leave one rank the straggler), is split by rows over every rank (row_wise), or
   over one node's ranks (table_row_wise) when that fits, keeping its traffic on the node.
4. If even an even split cannot fit the budget, PlanError says how much memory is needed.
0. Before these, with a `disk_tier`: when all tables do not fit the budget, the largest go on
   disk (row-split, `on_disk`), until the others plus the caches fit (disk_budget.py).

`plan_collections` applies these rules once to the tables of every collection of a model, so
the ranks balance over all of them; collections planned one by one each start from empty ranks
and pile their largest tables onto the same ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from manualpar.embeddings.config import (
    ROW_WISE_STATE,
    EmbeddingBagConfig,
    block_bytes,
    check_tables,
)
from manualpar.embeddings.kernels.row_memory import agreed_available_bytes
from manualpar.embeddings.modules.bag_collection import EmbeddingBagCollection
from manualpar.embeddings.modules.sequence_collection import EmbeddingCollection
from manualpar.embeddings.optim.update_rules import SparseOptimizer
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
from manualpar.embeddings.planning.cost_model import Workload, rule_costs
from manualpar.embeddings.planning.cost_planner import plan_by_cost
from manualpar.embeddings.planning.disk_budget import place_on_disk
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
REPLICATE_BYTES = 256 * 2**10  # tables up to this size (with state) are replicated
METHODS = ("cost", "memory")
DEFAULT_BATCH_PER_RANK = 1024  # samples a rank per step, when the caller does not say


def default_topology(
    world_size: int, ranks_per_node: int | None = None, device_type: str = "cpu"
) -> Topology:
    """The topology a plan assumes when none is given: the measured CPU host for CPU jobs, an
    A100 node (datasheet numbers) for GPU jobs; pass your own (`load_topology`) to plan for
    another machine."""
    preset = "cpu-host" if device_type == "cpu" else "a100-nvlink-hdr"
    return load_topology(preset, world_size, ranks_per_node)


def table_bytes(config: EmbeddingBagConfig, optimizer: SparseOptimizer | None = None) -> int:
    """A whole table's weights plus `optimizer`'s state (row-wise Adagrad's if none given)."""
    state = optimizer.STATE if optimizer is not None else ROW_WISE_STATE
    return block_bytes(config.num_embeddings, config.embedding_dim, state, config.dtype)


def plan_tables(
    tables: Sequence[EmbeddingBagConfig],
    world_size: int,
    *,
    ranks_per_node: int | None = None,
    memory_budget_bytes: int | None = None,
    optimizer: SparseOptimizer | None = None,
    pooling_factors: Mapping[str, float] | None = None,
    replicate_bytes: int = REPLICATE_BYTES,
    disk_tier: DiskTier | None = None,
    method: str = "cost",
    topology: Topology | None = None,
    batch_per_rank: int | None = None,
    replicas: int = 1,
    skew: float = 0.0,
) -> EmbeddingPlan:
    """A plan for `tables` on `world_size` ranks; see the module docstring. With method="cost",
    `topology` (default: default_topology) prices the plan for `batch_per_rank` samples a rank
    and `pooling_factors` ({table: mean ids per bag}) ids a sample, drawn uniformly or with
    Zipf(`skew`) popularity. `replicas` > 1: the plan is for the shard dim (`world_size` ranks)
    of a replicas x world_size mesh."""
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
    replicate_bytes: int = REPLICATE_BYTES,
    mesh: DeviceMesh | None = None,
    disk_tier: DiskTier | None = None,
    method: str = "cost",
    topology: Topology | None = None,
    batch_per_rank: int | None = None,
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
    collections, notes and errors name a table "collection.table".
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
    replicate_bytes: int,
    disk_tier: DiskTier | None,
    cost: _Cost,
) -> tuple[dict[str, TablePlacement], dict[str, str]]:
    """Placements and notes by the module docstring's rules, keyed (and named in errors) by the
    keys of `tables`, in their order."""
    if cost.method not in METHODS:
        raise PlanError(f"plan method must be one of {METHODS}, got {cost.method!r}")
    net = budget_after_remappers(tables.values(), world_size, budget)  # (its error first)
    if cost.method == "cost":
        if disk_tier is None or budget is None:
            _check_fits(sizes, world_size, net)
        topology = cost.topology_for(world_size, ranks_per_node)
        planned = plan_by_cost(
            tables,
            topology,
            cost.workload(tables, pooling),
            memory_budget_bytes=budget,
            replicate_bytes=replicate_bytes,
            disk_tier=disk_tier,
            replicas=cost.replicas,
        )
        return dict(planned.plan.tables), dict(planned.plan.notes)
    return _place_by_memory(
        tables, sizes, pooling, world_size, ranks_per_node, net, replicate_bytes, disk_tier
    )


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
        )


def _place_by_memory(
    tables: Mapping[str, EmbeddingBagConfig],
    sizes: Mapping[str, int],
    pooling: Mapping[str, float],
    world_size: int,
    ranks_per_node: int,
    budget: int | None,
    replicate_bytes: int,
    disk_tier: DiskTier | None,
) -> tuple[dict[str, TablePlacement], dict[str, str]]:
    """method="memory": the rules of the module docstring."""
    order = list(tables)
    on_disk, disk_notes, budget = place_on_disk(tables, sizes, world_size, budget, disk_tier)
    if on_disk:
        tables = {k: c for k, c in tables.items() if k not in on_disk}
        sizes = {k: b for k, b in sizes.items() if k not in on_disk}
    _check_fits(sizes, world_size, budget)
    memory = [0] * world_size
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
        fits = [r for r in range(world_size) if budget is None or memory[r] + size <= budget]
        too_big = world_size > 1 and size > even_share * 1.0001
        if fits and not too_big:
            rank = min(fits, key=load)
            placements[name] = table_wise(rank)
            notes[name] = f"whole on rank {rank} ({format_bytes(size)}; least-loaded rank)"
            memory[rank] += size
            work[rank] += lookups
            continue
        reason = "fits no single rank's budget" if not fits else "larger than an even share"
        nodes = world_size // ranks_per_node
        node_share = -(-size // ranks_per_node)
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
        share = -(-size // world_size)
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
    placements.update(on_disk)
    notes.update(disk_notes)
    return {k: placements[k] for k in order}, {k: notes[k] for k in order}


def _check_fits(sizes: Mapping[str, int], world_size: int, budget: int | None) -> None:
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


# plan_uniform(kind, ...) and `python -m manualpar plan --plan KIND`: one kind for all tables.
UNIFORM_PLANS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


def plan_uniform(
    sharding: str,
    tables: Sequence[EmbeddingBagConfig],
    world_size: int,
    *,
    ranks_per_node: int | None = None,
    memory_budget_bytes: int | None = None,
    optimizer: SparseOptimizer | None = None,
) -> EmbeddingPlan:
    """Every table placed the same way: table_wise and table_row_wise put the largest tables
    first on the least-loaded rank (node); the others split every table over all ranks.

    Unlike `plan_tables`, the placement does not adapt to the budget: a rank it overflows
    raises PlanError naming the rank.
    """
    if sharding not in UNIFORM_PLANS:
        raise PlanError(f"sharding must be one of {UNIFORM_PLANS}, got {sharding!r}")
    per_node = ranks_per_node or world_size
    if sharding == "table_wise":
        placements = _least_loaded(tables, world_size, optimizer, table_wise)
    elif sharding == "table_row_wise":
        placements = _least_loaded(
            tables, world_size // per_node, optimizer, lambda node: table_row_wise(node, per_node)
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
    state = optimizer.STATE if optimizer is not None else ROW_WISE_STATE
    per_rank = plan.bytes_per_rank(tables, state)
    budget = memory_budget_bytes
    over = [rank for rank, size in enumerate(per_rank) if budget is not None and size > budget]
    if over:
        rank = max(over, key=lambda r: per_rank[r])
        raise PlanError(
            f"plan {sharding} puts {format_bytes(per_rank[rank])} on rank {rank}, more than the "
            f"memory budget of {format_bytes(budget or 0)}; try plan 'auto', more ranks or a "
            "larger budget"
        )
    return plan


def _least_loaded(
    tables: Sequence[EmbeddingBagConfig],
    bins: int,
    optimizer: SparseOptimizer | None,
    place: Callable[[int], TablePlacement],
) -> dict[str, TablePlacement]:
    """Largest table first, each to the bin (rank or node) with the fewest bytes so far."""
    load, placements = [0] * bins, {}
    for config in sorted(tables, key=lambda c: table_bytes(c, optimizer), reverse=True):
        target = load.index(min(load))
        placements[config.name] = place(target)
        load[target] += table_bytes(config, optimizer)
    return {c.name: placements[c.name] for c in tables}
