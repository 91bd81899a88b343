"""plan="auto": the placement of every table that keeps the slowest rank's predicted step shortest.

Candidates per table, each costed by the model (cost_model.py) on top of the tables already
placed: replicated (tables up to `replicate_bytes`), whole on one of the least-busy ranks, rows
over all ranks or over one of the least-busy nodes, columns over the least-busy 2 to 32 ranks,
and on disk when a DiskTier is given. Candidates that overflow the memory budget are dropped.
Three passes:
1. greedy: costliest table first (whole on one rank), each where the least the slowest rank can
   end at grows least (plan_score.py); TorchRec's greedy partitioner also goes largest first;
2. tighten: bisect a target time between the mean and the greedy's result, placing every table
   anew at its cheapest time over all ranks that keeps every rank under the target (the greedy
   spends other ranks' time freely to shorten the slowest one now);
3. refine: move single tables while the slowest rank, then the number of nearly-as-slow ranks,
   falls.
It is a heuristic, not an exhaustive search; each table's note says what it adds to the slowest
rank and which candidate came second and why, so a plan can be checked.
With several wire dtypes allowed (PlanConstraints.wire_dtypes), the passes run once for each,
every collection's exchanges in it, and the fastest plan is kept (the more precise wire on a
tie); then each collection takes its fastest wire with those placements (wire_choice.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.exchange_layout import WireDtypes
from manualpar.embeddings.plan import EmbeddingPlan, TablePlacement
from manualpar.embeddings.planning.candidates import COST_REPLICATE_BYTES
from manualpar.embeddings.planning.constraints import PlanConstraints, resolve
from manualpar.embeddings.planning.plan_notes import search_notes, wire_note
from manualpar.embeddings.planning.plan_score import plan_score
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.planning.search import Search
from manualpar.embeddings.planning.topology import Topology
from manualpar.embeddings.planning.wire_choice import WireChoice, choose_wires
from manualpar.embeddings.planning.workload import Workload
from manualpar.embeddings.storage.cached_tier import CachedTier

__all__ = ["CostPlan", "plan_by_cost"]


@dataclass(frozen=True)
class CostPlan:
    """The chosen plan, its predicted costs per rank, and each table's cost on its own; with
    wire dtypes allowed, each collection's pick (`wires`, by the names of plan_by_cost's
    `collections`; "" for tables of none), which `plan.wire` records for a single one."""

    plan: EmbeddingPlan  # for one shard group when replicas > 1
    costs: RankCosts  # per rank of the plan (the same in every shard group)
    topology: Topology  # the whole job
    table_seconds: dict[str, float]  # each table's added time on the slowest rank
    replicas: int = 1
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # rows stored in another dtype
    wires: dict[str, WireChoice] = field(default_factory=dict)

    @property
    def seconds(self) -> torch.Tensor:
        return self.costs.seconds(self.topology)


def plan_by_cost(
    tables: Mapping[str, EmbeddingBagConfig],
    topology: Topology,
    workload: Workload,
    *,
    constraints: PlanConstraints | None = None,
    memory_budget_bytes: int | None = None,
    replicate_bytes: int | None = None,
    disk_tier: CachedTier | None = None,
    replicas: int = 1,
    precisions: Sequence[torch.dtype] | None = None,
    pinned: Mapping[str, TablePlacement] | None = None,
    wire_dtypes: Sequence[WireDtypes | torch.dtype | str] | None = None,
    collections: Mapping[str, str] | None = None,
) -> CostPlan:
    """Place `tables` (keyed by the names used in notes and errors, e.g. "collection.table") on
    `topology` for `workload`, within `memory_budget_bytes` per rank (managed-collision
    remappers' state included); see the module docstring. With `replicas` > 1 the plan is for
    one shard group of a 2-D mesh (world / replicas ranks), costed with the replicas' sums.
    `precisions` (e.g. float32, bfloat16): the row dtypes a table may take, most precise first;
    a table takes a less precise one only where no placement of a more precise one fits the
    budget, and before any goes on disk (`CostPlan.dtypes` lists the tables it changed).
    `pinned`: {table: placement} kept as given, their costs counted before the others are
    placed (planner.py checks them and applies the disk rule this way). `wire_dtypes`: the
    wire dtypes a collection may take (PlanConstraints.wire_dtypes; `collections`: table key
    -> collection, default all one). `constraints`: the same limits as one PlanConstraints (its
    `dtypes` are `precisions`), instead of keywords."""
    limits, _ = resolve(
        "plan_by_cost()",
        constraints,
        None,
        {
            "memory_budget_bytes": memory_budget_bytes,
            "replicate_bytes": replicate_bytes,
            "disk_tier": disk_tier,
            "dtypes": precisions,
            "pinned": pinned,
            "wire_dtypes": wire_dtypes,
        },
    )
    replicate = COST_REPLICATE_BYTES if limits.replicate_bytes is None else limits.replicate_bytes
    allowed = limits.wires if limits.wire_dtypes else (workload.wire,)
    # the fastest, the first (more precise wire) of equals; the others are dropped as they
    # lose, each with its price cache (price_cache.py)
    search = _search(
        tables, topology, replace(workload, wire=allowed[0]), limits, replicate, replicas
    )
    for wire in allowed[1:]:
        found = _search(tables, topology, replace(workload, wire=wire), limits, replicate, replicas)
        if _final(found) < _final(search):
            search = found
    wires = choose_wires(search, allowed, collections or {}) if limits.wire_dtypes else {}
    single = next(iter(wires.values())) if len(wires) == 1 else None
    plan = EmbeddingPlan(
        search.group.world_size,
        dict(search.placements),
        search_notes(search),
        single.wire if single else None,
        wire_note(single) if single else "",
    )
    added = {
        key: float(search.total.seconds(topology).max())
        - float((search.total - search.chosen_costs(key)).seconds(topology).max())
        for key in tables
    }
    changed = {k: d for k, d in search.dtype.items() if d != tables[k].dtype}
    return CostPlan(plan, search.total, topology, added, replicas, changed, wires)


def _final(search: Search) -> tuple[float, ...]:
    return plan_score(search.total, search.topology, 0.0).final()


def _search(
    tables: Mapping[str, EmbeddingBagConfig],
    topology: Topology,
    workload: Workload,
    limits: PlanConstraints,
    replicate: int,
    replicas: int,
) -> Search:
    """The search's passes for `workload` (module docstring)."""
    search = Search(
        tables,
        topology,
        workload,
        limits.memory_budget_bytes,
        replicate,
        limits.disk_tier,
        replicas,
        limits.dtypes,
        dict(limits.pinned),
    )
    search.greedy()
    search.tighten()
    search.try_seeds()
    search.refine()
    return search
