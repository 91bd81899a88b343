"""The plan command's layouts: one plan per replica count (1-D, or 2-D with N replicas), each
priced by the cost model, and the lines that compare them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from manualpar import PlanError
from manualpar.embeddings import DiskTier, EmbeddingBagConfig, EmbeddingPlan
from manualpar.embeddings.planning import (
    RankCosts,
    Topology,
    Workload,
    format_bytes,
    format_seconds,
    plan_by_cost,
    plan_costs,
)

__all__ = ["Layout", "layouts_text", "plan_layouts"]


@dataclass(frozen=True)
class Layout:
    """A plan for the shard groups of `replicas` copies, its costs, and the tables as planned
    (their dtypes as the planner chose with --precisions)."""

    replicas: int
    plan: EmbeddingPlan
    costs: RankCosts
    tables: list[EmbeddingBagConfig]

    def slowest(self, topology: Topology) -> float:
        return float(self.costs.seconds(topology).max())


def plan_layouts(
    tables: list[EmbeddingBagConfig],
    choices: Sequence[int],
    topology: Topology,
    workload: Workload,
    budget: int | None,
    precisions: tuple[torch.dtype, ...],
    place: Callable[..., EmbeddingPlan],
    cost_kwargs: bool,
    disk_tier: DiskTier | None = None,
    wire_dtypes: tuple[str, ...] = (),
) -> tuple[list[Layout], list[tuple[int, PlanError]]]:
    """A layout per replica count in `choices` (`place(tables, shard_ranks, ranks_per_node=,
    [replicas=])` makes each plan, or the cost planner itself with `precisions`), and the counts
    whose plan does not fit, with the planner's error; raises the first if none fits. Disk
    tables are priced with `disk_tier`'s cache in memory, as the job holds them, and each plan
    with the wire dtypes it records (`wire_dtypes`: those the planner may choose)."""
    layouts, refused = [], []
    for replicas in choices:
        shard = topology.world_size // replicas
        try:
            if precisions:
                planned = plan_by_cost(
                    {t.name: t for t in tables},
                    topology,
                    workload,
                    memory_budget_bytes=budget,
                    replicas=replicas,
                    precisions=precisions,
                    wire_dtypes=wire_dtypes,
                )
                plan = planned.plan
                stored = [
                    dataclasses.replace(t, dtype=planned.dtypes.get(t.name, t.dtype))
                    for t in tables
                ]
            else:
                options = {"replicas": replicas} if cost_kwargs else {}
                per_node = min(topology.ranks_per_node, shard)
                plan = place(tables, shard, ranks_per_node=per_node, **options)
                stored = tables
        except PlanError as error:  # e.g. a full copy per 1/replicas of the ranks does not fit
            refused.append((replicas, error))
            continue
        costs = plan_costs(stored, plan, topology, workload, disk_tier, replicas=replicas)
        layouts.append(Layout(replicas, plan, costs, stored))
    if not layouts:
        raise refused[0][1]
    return layouts, refused


def layouts_text(
    layouts: list[Layout],
    refused: list[tuple[int, PlanError]],
    topology: Topology,
    best: int,
) -> str:
    """One line per layout tried: its predicted slowest rank and memory on the fullest rank,
    or why it cannot be planned."""
    lines = ["layouts (predicted slowest rank, fullest rank's memory):"]
    world = topology.world_size

    def name(replicas: int) -> str:
        return "1-D" if replicas == 1 else f"2-D {replicas} x {world // replicas}"

    for layout in layouts:
        mark = "  <- chosen" if layout.replicas == best else ""
        slowest = format_seconds(layout.slowest(topology))
        memory = format_bytes(float(layout.costs.memory.max()))
        lines.append(f"  {name(layout.replicas):<14} {slowest:>10}  {memory}{mark}")
    for replicas, error in refused:
        lines.append(f"  {name(replicas):<14} does not fit: {str(error).split(';')[0]}")
    return "\n".join(lines)
