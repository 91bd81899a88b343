"""Plans from table sizes: `plan_tables` (plan="auto"), the stages run in order.

1. The constraints are checked (constraints.py, disk_budget.py, remapper_budget.py): pinned
   tables name known tables and existing ranks, a disk tier is on a 1-D layout, the managed-
   collision remappers' share of every rank comes off the budget.
2. The disk rule: with a disk tier and a budget the tables overflow, the largest unpinned tables
   go on disk, in order, until the rest plus the caches fit (disk_budget.py); the pinned ones and
   those are then fixed, and an even split of the rest must fit the budget (fit_errors.py).
3. The search places the rest around them at the least price (PlanOptions.price): "time", the
   slowest rank's predicted step time on a Topology (search.py over the candidates of
   candidates.py, priced by cost_model.py; cost_planner.py), or "memory", memory and lookups
   balanced per rank (memory_planner.py).
4. Explain: each table's note says why it went where it did (plan_notes.py), and with wire
   dtypes allowed (PlanConstraints.wire_dtypes), the plan records each collection's pick and
   why (EmbeddingPlan.wire, wire_note).

`plan_collections` (collection_plans.py) plans the tables of several collections at once through
the same stages; `plan_uniform` (memory_planner.py) gives every table one placement kind.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.optim.update_rules import UpdateRule
from manualpar.embeddings.plan import EmbeddingPlan, TablePlacement, row_wise
from manualpar.embeddings.planning.candidates import COST_REPLICATE_BYTES
from manualpar.embeddings.planning.constraints import (
    PlanConstraints,
    PlanOptions,
    refuse_dtypes,
    resolve,
)
from manualpar.embeddings.planning.cost_planner import plan_by_cost
from manualpar.embeddings.planning.disk_budget import (
    check_pinned,
    check_tier_layout,
    place_on_disk,
)
from manualpar.embeddings.planning.fit_errors import check_fits
from manualpar.embeddings.planning.memory_planner import (
    REPLICATE_BYTES,
    UNIFORM_PLANS,
    place_by_memory,
    plan_uniform,
    table_bytes,
)
from manualpar.embeddings.planning.plan_notes import wire_note
from manualpar.embeddings.planning.remapper_budget import budget_after_remappers
from manualpar.embeddings.planning.topology import Topology, load_topology
from manualpar.embeddings.planning.wire_choice import WireChoice
from manualpar.embeddings.planning.workload import Workload, rule_costs, sequence_padding
from manualpar.errors import PlanError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from manualpar.embeddings.planning.constraints import PlanKeywords

__all__ = [
    "DEFAULT_BATCH_PER_RANK",
    "UNIFORM_PLANS",
    "default_topology",
    "plan_tables",
    "plan_uniform",
    "table_bytes",
]

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
    constraints: PlanConstraints | None = None,
    options: PlanOptions | None = None,
    **keywords: Unpack[PlanKeywords],
) -> EmbeddingPlan:
    """A plan for `tables` on `world_size` ranks (the module docstring's stages) within
    `constraints`, priced as `options` say; each of their fields may be given as a keyword
    instead (`plan_tables(tables, 8, memory_budget_bytes=2**30, pinned={...})`). The dtypes a
    table may take (PlanConstraints.dtypes) need plan_by_cost, whose result says which table
    went to which dtype."""
    limits, priced = resolve("plan_tables()", constraints, options, keywords)
    refuse_dtypes("plan_tables()", limits)
    rule = priced.rule
    placements, notes, wires = place(
        {c.name: c for c in tables},
        {c.name: table_bytes(c, rule) for c in tables},
        {c.name: float((priced.pooling_factors or {}).get(c.name, 1.0)) for c in tables},
        world_size,
        limits,
        Pricing(priced, rules=dict.fromkeys((c.name for c in tables), rule)),
    )
    return planned(world_size, placements, notes, wires.get(""))


def planned(
    world_size: int,
    placements: dict[str, TablePlacement],
    notes: dict[str, str],
    wire: WireChoice | None,
) -> EmbeddingPlan:
    """One collection's plan, with its wire dtypes and why where the planner chose them."""
    if wire is None:
        return EmbeddingPlan(world_size, placements, notes)
    return EmbeddingPlan(world_size, placements, notes, wire.wire, wire_note(wire))


@dataclass(frozen=True)
class Pricing:
    """How a call prices plans: its PlanOptions, with what plan_collections adds (each table's
    update rule, the device, the job's ranks per node, each table's collection)."""

    options: PlanOptions
    rules: Mapping[str, UpdateRule | None] = field(default_factory=dict)
    device_type: str = "cpu"
    job_ranks_per_node: int | None = None  # the launcher's, when the plan is for a mesh dim
    collection_of: Mapping[str, str] = field(default_factory=dict)  # table key -> collection

    def topology_for(self, world_size: int) -> Topology:
        """The whole job's topology (`world_size` ranks per shard group, `replicas` groups)."""
        given = self.options
        world = world_size * given.replicas
        per_node = self.job_ranks_per_node or given.ranks_per_node or world_size
        if given.topology is None:
            return default_topology(world, per_node, self.device_type)
        if given.topology.world_size != world:
            return given.topology.with_world(world, per_node)
        return given.topology

    def workload(
        self, tables: Mapping[str, EmbeddingBagConfig], pooling: Mapping[str, float]
    ) -> Workload:
        given = self.options
        state, full_rows = rule_costs(given.rule)
        return Workload(
            batch_per_rank=given.batch_per_rank or DEFAULT_BATCH_PER_RANK,
            ids_per_bag=dict(pooling),
            bags_per_feature=dict(given.bags_per_feature or {}),
            state=state,
            full_rows=full_rows,
            rules={name: rule_costs(self.rules.get(name, given.rule)) for name in tables},
            skew=given.skew,
            padded_ids=sequence_padding(tables, pooling, self.collection_of),
        )


def place(
    tables: Mapping[str, EmbeddingBagConfig],
    sizes: Mapping[str, int],
    pooling: Mapping[str, float],
    world_size: int,
    limits: PlanConstraints,
    pricing: Pricing,
) -> tuple[dict[str, TablePlacement], dict[str, str], dict[str, WireChoice]]:
    """Placements and notes by the module docstring's stages, keyed (and named in errors) by
    the keys of `tables`, in their order, and with wire dtypes allowed, each collection's
    (by Pricing.collection_of's names; "" for one)."""
    budget, tier, replicas = limits.memory_budget_bytes, limits.disk_tier, pricing.options.replicas
    check_tier_layout(tier, replicas)  # before any budget error
    pinned = check_pinned(limits.pinned, tables, world_size, tier)
    net = budget_after_remappers(tables.values(), world_size, budget)  # (its error first)
    per_node = pricing.options.ranks_per_node or world_size
    if pricing.options.price == "memory":
        if limits.wire_dtypes:
            raise PlanError(
                "wire_dtypes= needs price='time': the memory price does not weigh the "
                "exchanges; plan by time, or pass shard_embeddings(..., wire_dtype=...) yourself"
            )
        replicate = REPLICATE_BYTES if limits.replicate_bytes is None else limits.replicate_bytes
        placements, notes = place_by_memory(
            tables, sizes, pooling, world_size, per_node, net, replicate, tier, pinned
        )
        return placements, notes, {}
    # the documented disk rule first: the largest tables on disk until the rest fits
    disk, disk_notes, left = place_on_disk(tables, sizes, world_size, net, tier, pinned)
    fixed = {**pinned, **disk}
    check_fits(
        {k: b for k, b in sizes.items() if not fixed.get(k, _IN_MEMORY).on_disk}, world_size, left
    )
    chosen = plan_by_cost(
        tables,
        pricing.topology_for(world_size),
        pricing.workload(tables, pooling),
        constraints=dataclasses.replace(
            limits,
            replicate_bytes=(
                COST_REPLICATE_BYTES if limits.replicate_bytes is None else limits.replicate_bytes
            ),
            pinned=fixed,
        ),
        replicas=replicas,
        collections=pricing.collection_of,
    )
    notes = {**chosen.plan.notes, **disk_notes}
    return dict(chosen.plan.tables), {key: notes[key] for key in tables}, chosen.wires
