"""The search stage: the placement of every table that keeps the slowest rank's predicted step
shortest, under the constraints (planner.py and cost_planner.py run it; the module docstring of
cost_planner.py gives its passes).

`Search` holds the plan being built and each (table, placement, dtype)'s priced costs: the
candidates come from candidates.py, their prices from cost_model.py, the ordering of two
options from plan_score.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from manualpar.embeddings.config import EmbeddingBagConfig, block_bytes
from manualpar.embeddings.plan import (
    EmbeddingPlan,
    TablePlacement,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.planning.block_costs import disk_blocks
from manualpar.embeddings.planning.candidates import candidates
from manualpar.embeddings.planning.cost_model import collection_costs, shard_group
from manualpar.embeddings.planning.fit_errors import no_room
from manualpar.embeddings.planning.memory_planner import REPLICATE_BYTES, place_by_memory
from manualpar.embeddings.planning.plan_score import Option, plan_score
from manualpar.embeddings.planning.price_cache import PriceCache
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.planning.topology import Topology
from manualpar.embeddings.planning.workload import Workload
from manualpar.embeddings.storage.cached_tier import CachedTier
from manualpar.errors import PlanError

__all__ = ["Search"]

REFINE_ROUNDS = 3  # passes of single-table moves after the greedy (more rarely moved anything)
TIGHTEN_STEPS = 8  # bisection steps of the target time (each places every table once)
TIGHTEN_TOLERANCE = 0.01  # stop bisecting within 1% of the best time found


class Search:
    """The greedy placement and its refinement, with each (table, placement)'s costs cached."""

    def __init__(
        self,
        tables: Mapping[str, EmbeddingBagConfig],
        topology: Topology,
        workload: Workload,
        budget: int | None,
        replicate_bytes: int,
        disk_tier: CachedTier | None,
        replicas: int = 1,
        precisions: tuple[torch.dtype, ...] = (),
        pinned: Mapping[str, TablePlacement] | None = None,
    ) -> None:
        self.tables, self.topology, self.workload = tables, topology, workload
        self.pinned = dict(pinned or {})
        self.precisions = precisions
        self.replicas = replicas
        self.group = shard_group(topology, replicas) if replicas > 1 else topology
        self.budget, self.replicate_bytes, self.disk_tier = budget, replicate_bytes, disk_tier
        self.sizes = {
            k: block_bytes(c.num_embeddings, c.embedding_dim, workload.rule(k)[0], c.dtype)
            for k, c in tables.items()
        }
        configs = list(tables.values())
        first = EmbeddingPlan(self.group.world_size, {c.name: row_wise() for c in configs})
        # remappers' shares too
        self.start = collection_costs(configs, first, topology, replicas, workload.wire)
        # the disk tables placed before the search (the rule's, the pins) share each rank's
        # cache: a disk table the search prices counts its part of it, not all of it
        pinned_on = {k: (tables[k], p) for k, p in self.pinned.items()}
        shared = disk_blocks(pinned_on, self.group.world_size, workload) if disk_tier else None
        self.prices = PriceCache(
            tables, topology, workload, disk_tier, replicas, self.group, shared
        )
        self.dtype: dict[str, torch.dtype] = {key: tables[key].dtype for key in self.pinned}
        # each placed table's placement and dtype: its costs are looked up (or recomputed)
        # when needed, not held, so the plan takes no world-size tensors per table
        self.fixed = {key: (p, tables[key].dtype) for key, p in self.pinned.items()}
        for key, placement in self.pinned.items():  # every pass starts with them placed
            self.start = self.start + self.costs(key, placement)
        self.total = self.start
        self.alone = {key: self._cheapest(key) for key in tables if key not in self.pinned}
        self.order = sorted(
            self.alone, key=lambda k: (self.alone[k][0], self.sizes[k]), reverse=True
        )
        self.placements: dict[str, TablePlacement] = dict(self.pinned)
        self.chosen: dict[str, tuple[TablePlacement, torch.dtype]] = dict(self.fixed)

    def _cheapest(self, key: str) -> tuple[float, float]:
        """A table's slowest rank whole on one rank (its place in the greedy order), and its
        least time over all ranks, whole or split by rows, without the collectives' latency
        that it shares with the other tables (its least share of the job's time)."""
        whole = self.costs(key, table_wise(0))
        summed = float(whole.seconds(self.topology, latency=False).sum())
        if self.group.world_size > 1 and self.tables[key].num_embeddings >= self.group.world_size:
            split = self.costs(key, row_wise())
            summed = min(summed, float(split.seconds(self.topology, latency=False).sum()))
        return float(whole.seconds(self.topology).max()), summed

    def costs(
        self, key: str, placement: TablePlacement, dtype: torch.dtype | None = None
    ) -> RankCosts:
        """`key`'s costs per rank in `placement` (in `dtype`, default the one it has now)."""
        return self.prices.costs(
            key, placement, dtype or self.dtype.get(key, self.tables[key].dtype)
        )

    def chosen_costs(self, key: str) -> RankCosts:
        """The costs of `key`'s placement in the plan."""
        placement, dtype = self.chosen[key]
        return self.costs(key, placement, dtype)

    def options(
        self, key: str, base: RankCosts, still_to_place: float, final: bool = False
    ) -> list[Option]:
        """Every candidate for `key` on top of `base` that fits the budget, best first (by the
        greedy's ordering, or with every other table placed, the `final` one)."""
        busy = base.seconds(self.topology)
        config = self.tables[key]
        weighed = list(
            candidates(
                config, self.sizes[key], self.group, busy, self.replicate_bytes, self.disk_tier
            )
        )
        order = (lambda o: o.score.final()) if final else (lambda o: o.score.greedy())
        # in memory before disk, and the most precise dtype that fits
        for to_disk in (False, True):
            tier = [p for p in weighed if p.on_disk == to_disk]
            for dtype in self.precisions or (config.dtype,):
                options = self._fitting(key, base, tier, dtype, still_to_place)
                if options:
                    return sorted(options, key=order)
        raise no_room(
            key, self.sizes[key], base, self.budget, self.group.world_size, self.disk_tier
        )

    def _fitting(
        self,
        key: str,
        base: RankCosts,
        placements: list[TablePlacement],
        dtype: torch.dtype,
        still_to_place: float,
    ) -> list[Option]:
        """`placements` of `key` in `dtype` that keep every rank within the budget."""
        options = []
        for placement in placements:
            costs = self.costs(key, placement, dtype)
            after = base + costs
            if self.budget is None or float(after.memory.max()) <= self.budget:
                score = plan_score(after, self.topology, still_to_place)
                options.append(Option(placement, costs, score, dtype))
        return options

    def place(self, key: str, option: Option) -> None:
        if key in self.chosen:
            self.total = self.total - self.chosen_costs(key)
        self.total = self.total + option.costs
        self.placements[key], self.chosen[key] = option.placement, (option.placement, option.dtype)
        self.dtype[key] = option.dtype

    def greedy(self) -> None:
        """Costliest table first, each where the job's slowest rank can end least late."""
        still_to_place = sum(summed for _, summed in self.alone.values())
        for key in self.order:
            still_to_place -= self.alone[key][1]
            self.place(key, self.options(key, self.total, still_to_place)[0])

    def pack(self, target: float) -> bool:
        """Place every table anew, costliest first, each at its least time over all ranks that
        keeps every rank within `target` seconds; False if some table cannot."""
        self.total, self.placements, self.chosen = self.start, dict(self.pinned), dict(self.fixed)
        still_to_place = sum(summed for _, summed in self.alone.values())
        for key in self.order:
            still_to_place -= self.alone[key][1]
            options = self.options(key, self.total, still_to_place)
            within = [o for o in options if o.score.slowest <= target]
            if not within:
                return False
            self.place(key, min(within, key=lambda o: (o.score.summed, o.score.slowest)))
        return True

    def tighten(self, steps: int = TIGHTEN_STEPS) -> None:
        """Bisect the slowest rank's time between the mean and the greedy's result, keeping the
        best plan `pack` finds. The greedy spends other ranks' time freely to shorten the slowest
        one now (a split over a node's 8 ranks sends 8 times the bytes of a whole table);
        packing to a target spends it only where the target needs it."""
        best = (dict(self.placements), dict(self.chosen), self.total)
        high = float(self.total.seconds(self.topology).max())
        low = float(self.start.seconds(self.topology).max())
        low = max(low, sum(summed for _, summed in self.alone.values()) / self.group.world_size)
        for _ in range(steps):
            target = (low + high) / 2
            if self.pack(target):
                high = float(self.total.seconds(self.topology).max())
                best = (dict(self.placements), dict(self.chosen), self.total)
            else:
                low = target
            if high - low <= TIGHTEN_TOLERANCE * high:
                break
        self.placements, self.chosen, self.total = best

    def adopt(self, placements: Mapping[str, TablePlacement]) -> bool:
        """Take `placements` (every table) if they fit the budget and beat the current plan."""
        placements = {**placements, **self.pinned}
        dtypes = {key: self.dtype.get(key, config.dtype) for key, config in self.tables.items()}
        chosen = {key: (placements[key], dtypes[key]) for key in self.tables}
        total = self.start  # (the pinned tables' costs included)
        for key in self.order:
            total = total + self.costs(key, *chosen[key])
        if self.budget is not None and float(total.memory.max()) > self.budget:
            return False
        now = plan_score(self.total, self.topology, 0.0).final()
        if plan_score(total, self.topology, 0.0).final() >= now:
            return False
        self.placements, self.chosen, self.total = dict(placements), chosen, total
        return True

    def try_seeds(self) -> None:
        """Start the refinement from the best of the plan so far and simple ones: every table
        whole, costliest first on the least-busy rank (or replicated where that costs less in
        all), every table's rows over one node (what TorchRec's planner chose at 64 and 512
        ranks), and the memory-only placement.
        Single-table moves cannot turn one layout into another (three tables on a rank where
        two belong need two moves, the first of which makes things worse)."""
        world = self.group.world_size
        for replicate in (False, True):  # also: replicated where that costs less in all
            busy = [0.0] * world
            whole = {}
            for key in self.order:
                if replicate and world > 1 and self.sizes[key] <= self.replicate_bytes:
                    copies = self.costs(key, data_parallel()).seconds(self.topology, False)
                    if float(copies.sum()) < self.alone[key][1]:
                        whole[key] = data_parallel()
                        continue
                rank = busy.index(min(busy))
                whole[key] = table_wise(rank)
                busy[rank] += self.alone[key][0]
            self.adopt(whole)
        per_node, nodes = self.group.ranks_per_node, self.group.nodes
        if nodes > 1:  # every table's rows over one node, the costliest first to the least busy
            node_busy = [0.0] * nodes
            split = {}
            for key in self.order:
                if self.tables[key].num_embeddings < per_node:
                    split[key] = table_wise(node_busy.index(min(node_busy)) * per_node)
                else:
                    split[key] = table_row_wise(node_busy.index(min(node_busy)), per_node)
                node_busy[node_busy.index(min(node_busy))] += self.alone[key][0]
            self.adopt(split)
        per_bag = {key: float(self.workload.ids_per_bag.get(key, 1.0)) for key in self.tables}
        try:
            by_memory, _ = place_by_memory(
                self.tables,
                self.sizes,
                per_bag,
                world,
                self.group.ranks_per_node,
                self.budget,
                REPLICATE_BYTES,
                self.disk_tier,
                self.pinned,
            )
        except PlanError:  # it cannot fit where the search did: nothing to try
            return
        self.adopt(by_memory)

    def refine(self, rounds: int = REFINE_ROUNDS) -> None:
        """Move single tables while that makes the slowest rank (then all ranks) faster: the
        greedy commits early and cannot see that, say, splitting its first table by columns
        would have evened out the ranks better."""
        for _ in range(rounds):
            moved = False
            for key in self.order:
                base = self.total - self.chosen_costs(key)
                now = plan_score(self.total, self.topology, 0.0).final()
                best = self.options(key, base, 0.0, final=True)[0]
                if best.score.final() < now and best.placement != self.placements[key]:
                    self.place(key, best)
                    moved = True
            if not moved:
                return
