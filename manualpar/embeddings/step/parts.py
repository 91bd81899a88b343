"""StepParts: what every phase of a sharded step works with, built once per collection.

The routing of its plan and the exchange layout derived from it, this rank's blocks and where
their rows live (storage/tier.py), the fused optimizer, and the strategy that carries the
exchanges inside the collection's shard group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.ids.remap import OwnerRemap
from manualpar.embeddings.kernels.rounding import accumulation_dtype
from manualpar.embeddings.modules.bag_collection import table_weight
from manualpar.embeddings.optim.fused_optimizer import FusedOptimizer
from manualpar.embeddings.step.exchange import ExchangeLayout
from manualpar.embeddings.step.routing import LocalShard, Routing
from manualpar.embeddings.step.table_mesh import TableMesh
from manualpar.embeddings.storage.tier import TableStores
from manualpar.strategy.collectives import PendingCollective

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["StepParts"]


@dataclass(frozen=True)
class StepParts:
    routing: Routing
    layout: ExchangeLayout
    tables: nn.ModuleDict  # this rank's block of each table (a disk table's: its cache)
    optimizer: FusedOptimizer
    stores: TableStores  # where each block's rows live; ids become slots through them
    strategy: ManualParallelStrategy
    normalize_by: str
    device: torch.device
    mesh: TableMesh  # the shard group the exchanges run in, and the replicas
    owner_remap: OwnerRemap | None = None  # raw-id tables remapped by their owner in the step

    def name(self, table: int) -> str:
        return self.routing.tables[table].name

    def table_names(self) -> list[str]:
        return [config.name for config in self.routing.tables]

    def weight(self, table: int) -> torch.Tensor:
        """This rank's block of table `table` (detached: the update is the fused optimizer's)."""
        return table_weight(self.tables, self.name(table)).detach()

    @property
    def dtype(self) -> torch.dtype:
        """The pooled output's dtype: float32 for half rows (rounding.accumulation_dtype)."""
        return accumulation_dtype(self.weight(0).dtype)

    def block_rows(self, shard: LocalShard) -> int:
        """Slots of this rank's block of the shard's table (its cache's, if on disk)."""
        return self.weight(shard.table).shape[0]

    @property
    def fuses_bags(self) -> bool:
        """Whether the rule's fused pass runs: not when replicas must first sum row gradients
        (2-D tables take the row-sum path, as global clipping does)."""
        return self.optimizer.fuses_bags and not self.mesh.combines

    @property
    def routes_any(self) -> bool:
        """Whether any table's ids travel to an owner: False when every table is replicated
        (data_parallel.py). Fixed by the plan, so every rank of the job answers alike."""
        return any(self.routing.routes_to)

    def exchange(
        self, tensor: torch.Tensor, send: list[int], receive: list[int], what: str
    ) -> PendingCollective:
        """Start one all_to_all of the step inside the shard group (elements per rank of the
        group); errors name `what`. None runs where no table is routed: every rank's splits
        are all 0 then, every rank knows it from the plan, and so every rank skips it alike
        (the size exchange, exchange_headers, still runs: refusals, frozen tables and the
        job's batch sizes travel in it)."""
        if not self.routes_any:
            nothing = tensor.new_empty(0)
            return PendingCollective(self.strategy, None, nothing, nothing, what)
        return self.strategy.all_to_all_async(
            tensor, send, receive, name=f"{BUILDER}: {what} all_to_all", group=self.mesh.shard
        )

    def exchange_headers(self, header: torch.Tensor, width: int) -> list[list[int]]:
        """Every job rank's size header (this rank sends `header`, `width` values per shard
        group rank). Over the whole job, not just the shard group, so that every replica
        agrees on refusals and frozen tables and knows the global batch; ranks outside the
        shard group get a payload length of 0."""
        mesh = self.mesh
        rows = header.view(mesh.shard_size, width)
        if mesh.shard_size != mesh.world_size:
            full = rows[:1].repeat(mesh.world_size, 1)
            full[:, 1] = 0
            full[list(mesh.group_ranks)] = rows
            rows = full
        received = self.strategy.all_to_all(
            rows.flatten(),
            [width] * mesh.world_size,
            [width] * mesh.world_size,
            name=f"{BUILDER}: ids all_to_all",
        )
        return received.view(mesh.world_size, width).tolist()
