"""What a step costs each rank (`RankCosts`): the prices stage's currency.

`RankCosts` holds per-rank totals as float64 tensors, adds and subtracts (a plan's total is the
sum of its tables'; the planner takes a table out to try another placement) and turns them into
seconds on a `Topology`. What the step does is `Workload`'s (workload.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from manualpar.embeddings.exchange_layout import FOLD_MAX
from manualpar.embeddings.planning.topology import Topology

__all__ = ["CALLS", "SIZES_WITH_IDS", "RankCosts"]

# Calls per step of each kind of collective: the exchanges of sharded tables (the sizes, ids,
# pooled rows and output gradients all_to_alls, step/exchange.py), one all_reduce of the
# replicated tables' gradients (step/data_parallel.py), on a 2-D mesh the two all_to_alls
# that sum the touched rows' gradients across the replicas (step/replica_combine.py), and the
# sizes all_to_all every collection runs (collection_costs), the first of the exchanges where
# some table is routed, alone where all are replicated (StepParts.exchange).
# A steady step of a 1-D mesh of more than one rank (collection_costs marks it: SIZES_WITH_IDS)
# sends the sizes inside the ids all_to_all while every ids payload to another rank is at most
# FOLD_MAX int64 values (step/ids_exchange.py): its exchanges are 3 calls (RankCosts.collectives;
# a first step's 4 are not priced). The ids' room beyond a payload is not priced either: a pair's
# room is the longest of its last payloads plus a quarter of their spread, so a steady batch pads
# nothing.
CALLS = {"exchanges": 4, "all_reduce": 1, "combine": 2, "sizes": 1}
# a `users` key beside CALLS': the collections whose sizes may ride in their ids all_to_all
SIZES_WITH_IDS = "sizes_with_ids"


@dataclass
class RankCosts:
    """Per-rank totals (float64 tensors of world_size) of one table or of a whole plan."""

    memory: torch.Tensor  # bytes held in memory: weights + state, caches
    disk: torch.Tensor  # bytes held on disk
    sent_intra: torch.Tensor
    sent_inter: torch.Tensor
    received_intra: torch.Tensor
    received_inter: torch.Tensor
    memory_traffic: torch.Tensor  # bytes read and written in memory by lookups and updates
    rows_touched: torch.Tensor  # rows looked up plus rows updated
    disk_traffic: torch.Tensor  # bytes read from and written to disk
    disk_rows: torch.Tensor  # rows read from or written to disk
    blocks: torch.Tensor  # table blocks the rank looks up and updates (fixed costs each)
    # bytes of the ids payload every other rank of the shard group sends the rank (lengths,
    # ids, weights: what decides whether the sizes ride with them, SIZES_WITH_IDS)
    ids_in: torch.Tensor
    users: dict[str, int] = field(default_factory=dict)  # tables per kind of collective (CALLS)

    @classmethod
    def zeros(cls, world_size: int) -> RankCosts:
        tensors: dict[str, Any] = {
            f.name: torch.zeros(world_size, dtype=torch.float64)
            for f in fields(cls)
            if f.name != "users"
        }
        return cls(**tensors)

    def __add__(self, other: RankCosts) -> RankCosts:
        sums: dict[str, Any] = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name != "users"
        }
        users = {
            k: self.users.get(k, 0) + other.users.get(k, 0) for k in {*self.users, *other.users}
        }
        return RankCosts(**sums, users=users)

    def __sub__(self, other: RankCosts) -> RankCosts:
        """These costs without `other`'s (a table taken out of a plan's total)."""
        rest: dict[str, Any] = {
            f.name: getattr(self, f.name) - getattr(other, f.name)
            for f in fields(self)
            if f.name != "users"
        }
        users = {k: self.users.get(k, 0) - other.users.get(k, 0) for k in self.users}
        return RankCosts(**rest, users=users)

    @property
    def nbytes(self) -> int:
        """Bytes of the per-rank tensors."""
        return sum(getattr(self, f.name).nbytes for f in fields(self) if f.name != "users")

    @property
    def collectives(self) -> int:
        """Collective calls per step: each kind some table uses runs once for all of them (the
        sizes all_to_all is one of the exchanges where they run, and inside the ids all_to_all
        where SIZES_WITH_IDS marks a 1-D mesh and no ids payload to a rank exceeds FOLD_MAX)."""
        kinds = {kind for kind, tables in self.users.items() if tables > 0}
        calls = sum(CALLS[kind] for kind in kinds & CALLS.keys())
        if "exchanges" in kinds:
            calls -= CALLS["sizes"] if "sizes" in kinds else 0
            short = float(self.ids_in.max()) <= FOLD_MAX * 8  # (int64 ids)
            if SIZES_WITH_IDS in kinds and short:
                calls -= 1
        return calls

    @property
    def sent(self) -> torch.Tensor:
        return self.sent_intra + self.sent_inter

    @property
    def received(self) -> torch.Tensor:
        return self.received_intra + self.received_inter

    def seconds(self, topology: Topology, latency: bool = True) -> torch.Tensor:
        """The predicted step time of each rank (module docstring); without the collectives'
        `latency`, which a step pays once however many tables share its collectives."""
        intra = torch.maximum(self.sent_intra, self.received_intra)
        inter = torch.maximum(self.sent_inter, self.received_inter)
        links = torch.maximum(
            intra / topology.intra_node_bandwidth, inter / topology.inter_node_bandwidth
        )
        per_call = (
            topology.inter_node_latency if topology.nodes > 1 else topology.intra_node_latency
        )
        memory = (
            self.memory_traffic / topology.memory_bandwidth
            + self.rows_touched * topology.row_seconds
            + self.blocks * topology.block_seconds
        )
        disk = (
            self.disk_traffic / topology.disk_bandwidth if topology.disk_bandwidth > 0 else 0.0
        ) + self.disk_rows * topology.disk_row_seconds
        calls = self.collectives if latency else 0
        return _shared_cores(links + calls * per_call + memory + disk, topology)


def _shared_cores(seconds: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Where a node has fewer cores than ranks (`cores_per_node`, CPU jobs), its ranks share
    them: a rank takes at least its node's total work over the cores. Measured on 4 processes
    over 2 cores, this turned the model's ranking of 8 plans into the measured one
    (docs/benchmarks.md). `seconds` may be one shard group's ranks (a 2-D mesh): a node then
    holds ranks_per_node / len(seconds) such groups, all alike."""
    cores, per_node = topology.cores_per_node, topology.ranks_per_node
    if not cores or cores >= per_node:
        return seconds
    ranks = seconds.numel()
    if ranks <= per_node:
        node_total = seconds.sum() * (per_node / ranks)
        return torch.clamp(seconds, min=float(node_total) / cores)
    node_total = seconds.view(-1, per_node).sum(dim=1, keepdim=True) / cores
    return torch.maximum(seconds.view(-1, per_node), node_total).flatten()
