"""plan="auto": the placement of every table that keeps the slowest rank's predicted step shortest.

Candidates per table, each costed by the model (cost_model.py) on top of the tables already
placed: replicated (tables up to `replicate_bytes`), whole on one of the least-busy ranks, rows
over all ranks or over one of the least-busy nodes, columns over the least-busy 2, 4 or 8 ranks,
and on disk when a DiskTier is given. Candidates that overflow the memory budget are dropped.
Three passes:
1. greedy: costliest table first (whole on one rank), each where the least the slowest rank can
   end at grows least (_score); TorchRec's greedy partitioner also goes largest first;
2. tighten: bisect a target time between the mean and the greedy's result, placing every table
   anew at its cheapest time over all ranks that keeps every rank under the target (the greedy
   spends other ranks' time freely to shorten the slowest one now);
3. refine: move single tables while the slowest rank, then the number of nearly-as-slow ranks,
   falls.
It is a heuristic, not an exhaustive search; each table's note says what it adds to the slowest
rank and which candidate came second and why, so a plan can be checked.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from manualpar.embeddings.config import EmbeddingBagConfig, block_bytes
from manualpar.embeddings.dtype_names import dtype_name
from manualpar.embeddings.ids.managed_collisions import remapper_bytes_per_rank
from manualpar.embeddings.plan import (
    EmbeddingPlan,
    TablePlacement,
    column_wise,
    data_parallel,
    format_bytes,
    on_disk,
    row_wise,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.planning.cost_model import (
    collection_costs,
    placement_costs,
    shard_group,
)
from manualpar.embeddings.planning.memory_planner import REPLICATE_BYTES, place_by_memory
from manualpar.embeddings.planning.rank_costs import RankCosts, Workload
from manualpar.embeddings.planning.topology import Topology
from manualpar.embeddings.storage.disk_tier import DiskTier
from manualpar.errors import PlanError

__all__ = ["CostPlan", "plan_by_cost"]

LEAST_BUSY = 4  # ranks (and nodes) tried for a whole table or a node's row split
# Replication is a candidate up to this size (weights + state): the model weighs its gradient
# all_reduce against the exchanges it saves (the memory-only planner stops at 256 KiB)
COST_REPLICATE_BYTES = 64 * 2**20
COLUMN_SPLITS = (2, 4, 8)
MIN_COLUMNS = 16  # a column block narrower than this costs more in ids than it saves
REFINE_ROUNDS = 3  # passes of single-table moves after the greedy (more rarely moved anything)
TIGHTEN_STEPS = 8  # bisection steps of the target time (each places every table once)
TIGHTEN_TOLERANCE = 0.01  # stop bisecting within 1% of the best time found


@dataclass(frozen=True)
class CostPlan:
    """The chosen plan, its predicted costs per rank, and each table's cost on its own."""

    plan: EmbeddingPlan  # for one shard group when replicas > 1
    costs: RankCosts  # per rank of the plan (the same in every shard group)
    topology: Topology  # the whole job
    table_seconds: dict[str, float]  # each table's added time on the slowest rank
    replicas: int = 1
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # rows stored in another dtype

    @property
    def seconds(self) -> torch.Tensor:
        return self.costs.seconds(self.topology)


@dataclass(frozen=True)
class _Score:
    """What a candidate leaves the job with; lower is better under either ordering."""

    bound: float  # the least the slowest rank can end at (see _score)
    slowest: float  # the slowest rank now
    hot: float  # time above 90% of the slowest, summed over ranks
    summed: float  # all ranks' time
    fullest: float  # the fullest rank's memory

    def greedy(self) -> tuple[float, ...]:
        """While placing: the bound, then the slowest rank, then the least work in all."""
        return (self.bound, self.slowest, self.summed, self.fullest)

    def final(self) -> tuple[float, ...]:
        """With every table placed: the slowest rank, then how many ranks are nearly as slow
        (several equally slow ranks must all cool before the maximum falls), then all work."""
        return (self.slowest, self.hot, self.summed, self.fullest)


@dataclass(frozen=True)
class _Option:
    placement: TablePlacement
    costs: RankCosts
    score: _Score
    dtype: torch.dtype


def _score(total: RankCosts, topology: Topology, still_to_place: float) -> _Score:
    """The bound is at least today's slowest rank, and at least the mean once the tables still
    to place add their least total time: a table whole on one rank is not refused for an
    imbalance the next tables will even out."""
    seconds = total.seconds(topology)
    slowest, summed = float(seconds.max()), float(seconds.sum())
    bound = max(slowest, (summed + still_to_place) / seconds.numel())
    hot = float((seconds - 0.9 * slowest).clamp(min=0).sum())
    return _Score(bound, slowest, hot, summed, float(total.memory.max()))


def _least_busy(values: torch.Tensor, count: int) -> list[int]:
    return torch.argsort(values, stable=True)[:count].tolist()


def _candidates(
    config: EmbeddingBagConfig,
    size: int,
    topology: Topology,
    busy: torch.Tensor,
    replicate_bytes: int,
    disk_tier: DiskTier | None,
) -> Iterator[TablePlacement]:
    world, per_node = topology.world_size, topology.ranks_per_node
    if world > 1 and size <= replicate_bytes:
        yield data_parallel()
    for rank in _least_busy(busy, LEAST_BUSY):
        yield table_wise(rank)
    if world > 1 and config.num_embeddings >= world:
        yield row_wise()
    if disk_tier is not None and config.num_embeddings >= world:
        yield on_disk(row_wise())
    nodes = topology.nodes
    if nodes > 1 and config.num_embeddings >= per_node:
        node_busy = busy.view(nodes, per_node).max(dim=1).values
        for node in _least_busy(node_busy, LEAST_BUSY):
            yield table_row_wise(node, per_node)
    for split in COLUMN_SPLITS:
        if split <= world and config.embedding_dim // split >= MIN_COLUMNS:
            yield column_wise(sorted(_least_busy(busy, split)))


def plan_by_cost(
    tables: Mapping[str, EmbeddingBagConfig],
    topology: Topology,
    workload: Workload,
    *,
    memory_budget_bytes: int | None = None,
    replicate_bytes: int = COST_REPLICATE_BYTES,
    disk_tier: DiskTier | None = None,
    replicas: int = 1,
    precisions: Sequence[torch.dtype] | None = None,
) -> CostPlan:
    """Place `tables` (keyed by the names used in notes and errors, e.g. "collection.table") on
    `topology` for `workload`, within `memory_budget_bytes` per rank (managed-collision
    remappers' state included); see the module docstring. With `replicas` > 1 the plan is for
    one shard group of a 2-D mesh (world / replicas ranks), costed with the replicas' sums.
    `precisions` (e.g. float32, bfloat16): the row dtypes a table may take, most precise first;
    a table takes a less precise one only where no placement of a more precise one fits the
    budget, and before any goes on disk (`CostPlan.dtypes` lists the tables it changed)."""
    search = _Search(
        tables,
        topology,
        workload,
        memory_budget_bytes,
        replicate_bytes,
        disk_tier,
        replicas,
        tuple(precisions or ()),
    )
    search.greedy()
    search.tighten()
    search.try_seeds()
    search.refine()
    plan = EmbeddingPlan(search.group.world_size, dict(search.placements), search.notes())
    added = {
        key: float(search.total.seconds(topology).max())
        - float((search.total - search.chosen[key]).seconds(topology).max())
        for key in tables
    }
    changed = {k: d for k, d in search.dtype.items() if d != tables[k].dtype}
    return CostPlan(plan, search.total, topology, added, replicas, changed)


class _Search:
    """The greedy placement and its refinement, with each (table, placement)'s costs cached."""

    def __init__(
        self,
        tables: Mapping[str, EmbeddingBagConfig],
        topology: Topology,
        workload: Workload,
        budget: int | None,
        replicate_bytes: int,
        disk_tier: DiskTier | None,
        replicas: int = 1,
        precisions: tuple[torch.dtype, ...] = (),
    ) -> None:
        self.tables, self.topology, self.workload = tables, topology, workload
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
        self.start = collection_costs(configs, first, topology, replicas)
        self.start.memory += remapper_bytes_per_rank(configs, topology.world_size)
        self.total = self.start
        self._cache: dict[tuple[str, TablePlacement, torch.dtype], RankCosts] = {}
        self.dtype: dict[str, torch.dtype] = {}
        self.alone = {key: self._cheapest(key) for key in tables}
        self.order = sorted(tables, key=lambda k: (self.alone[k][0], self.sizes[k]), reverse=True)
        self.placements: dict[str, TablePlacement] = {}
        self.chosen: dict[str, RankCosts] = {}

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
        config = self.tables[key]
        dtype = dtype or self.dtype.get(key, config.dtype)
        found = self._cache.get((key, placement, dtype))
        if found is None:
            found = placement_costs(
                config if dtype == config.dtype else replace(config, dtype=dtype),
                placement,
                self.topology,
                self.workload,
                self.disk_tier,
                key,
                self.replicas,
            )
            self._cache[(key, placement, dtype)] = found
        return found

    def options(
        self, key: str, base: RankCosts, still_to_place: float, final: bool = False
    ) -> list[_Option]:
        """Every candidate for `key` on top of `base` that fits the budget, best first (by the
        greedy's ordering, or with every other table placed, the `final` one)."""
        busy = base.seconds(self.topology)
        candidates = list(
            _candidates(
                self.tables[key],
                self.sizes[key],
                self.group,
                busy,
                self.replicate_bytes,
                self.disk_tier,
            )
        )
        # in memory before disk, and the most precise dtype that fits
        for to_disk in (False, True):
            for dtype in self.precisions or (self.tables[key].dtype,):
                options = []
                for placement in candidates:
                    if placement.on_disk != to_disk:
                        continue
                    costs = self.costs(key, placement, dtype)
                    after = base + costs
                    if self.budget is not None and float(after.memory.max()) > self.budget:
                        continue
                    score = _score(after, self.topology, still_to_place)
                    options.append(_Option(placement, costs, score, dtype))
                if options:
                    return sorted(
                        options, key=lambda o: o.score.final() if final else o.score.greedy()
                    )
        raise _no_room(
            key, self.sizes[key], base, self.budget, self.group.world_size, self.disk_tier
        )

    def place(self, key: str, option: _Option) -> None:
        if key in self.chosen:
            self.total = self.total - self.chosen[key]
        self.total = self.total + option.costs
        self.placements[key], self.chosen[key] = option.placement, option.costs
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
        self.total, self.placements, self.chosen = self.start, {}, {}
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
        chosen = {key: self.costs(key, placements[key]) for key in self.tables}
        total = self.start
        for costs in chosen.values():
            total = total + costs
        if self.budget is not None and float(total.memory.max()) > self.budget:
            return False
        now = _score(self.total, self.topology, 0.0).final()
        if _score(total, self.topology, 0.0).final() >= now:
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
                base = self.total - self.chosen[key]
                now = _score(self.total, self.topology, 0.0).final()
                best = self.options(key, base, 0.0, final=True)[0]
                if best.score.final() < now and best.placement != self.placements[key]:
                    self.place(key, best)
                    moved = True
            if not moved:
                return

    def notes(self) -> dict[str, str]:
        """Per table: what it adds to the slowest rank, and the runner-up given the others."""
        notes = {}
        for key in self.tables:
            base = self.total - self.chosen[key]
            placement, costs, dtype = self.placements[key], self.chosen[key], self.dtype[key]
            chosen = _Option(placement, costs, _score(base + costs, self.topology, 0.0), dtype)
            rest = [
                o
                for o in self.options(key, base, 0.0, final=True)
                if (o.placement, o.dtype) != (placement, dtype)
            ]
            before = float(base.seconds(self.topology).max())
            note = _note(chosen, rest, before, self.budget)
            if dtype != self.tables[key].dtype:
                note = (
                    f"in {dtype_name(dtype)}: in {dtype_name(self.tables[key].dtype)} it would "
                    f"exceed the {format_bytes(self.budget or 0)} budget per rank; {note}"
                )
            notes[key] = note
        return notes


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _note(best: _Option, rest: list[_Option], before: float, budget: int | None) -> str:
    """What `best` adds to the slowest rank and sends, and why the runner-up lost."""
    sent = float(best.costs.sent.max())
    ours = best.score
    text = f"slowest rank +{_ms(ours.slowest - before)}, up to {format_bytes(sent)} sent a rank"
    if best.placement.on_disk and not any(not o.placement.on_disk for o in rest):
        text = (
            f"on disk: in memory it would exceed the {format_bytes(budget or 0)} budget per "
            f"rank; rows split over all ranks, cached in memory; {text}"
        )
    if not rest:
        return text + "; the only candidate that fits"
    runner = rest[0]
    theirs = runner.score

    def more(a: float, b: float) -> bool:  # beyond rounding
        return a > b + 1e-9 * max(abs(b), 1e-12)

    if more(theirs.slowest, ours.slowest):
        why = f"slowest rank {_ms(theirs.slowest - ours.slowest)} slower"
    elif more(theirs.hot, ours.hot):
        why = "as slow a slowest rank, and more ranks nearly as slow"
    elif more(theirs.summed, ours.summed):
        why = f"as slow a slowest rank, {_ms(theirs.summed - ours.summed)} more over all ranks"
    else:
        why = f"same times, {format_bytes(theirs.fullest - ours.fullest)} more on the fullest rank"
    return f"{text}; runner-up {runner.placement}: {why}"


def _no_room(
    name: str,
    size: int,
    total: RankCosts,
    budget: int | None,
    world: int,
    disk_tier: DiskTier | None,
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
