"""ShardedTables: what both sharded collections are, a thin module over parts built once.

    TableBlocks  this rank's block of each table: weight, optimizer state, store (table_storage)
    remapper     the ManagedCollisions tables' remapper state (managed_collisions.py)
    FusedOptimizer and ShardedStep, handed the same blocks
    BatchInputs  checks, hashing, raw-id remaps, batches in flight (batch_inputs.py)
    TableHooks   the tables' state-dict and load hooks (table_hooks.py)
    lookup       a prepared batch's step as one autograd node (lookup.py)

A collection adds its input shape (the bags its batch becomes) and its output (pooled rows, or
each id's row): sharded/bag_collection.py, sharded/sequence_collection.py. The tables' state dict
holds each rank's blocks as LocalShards, so a checkpoint reshards on load to any plan or world
size; the checkpoint record (TableRecords) refuses one of tables with other rows, dim or raw-id
setting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.modules.bag_collection import EmbeddingBagCollection
from manualpar.embeddings.modules.sequence_collection import EmbeddingCollection
from manualpar.embeddings.modules.table_record import TableRecords
from manualpar.embeddings.optim.fused_optimizer import FusedOptimizer
from manualpar.embeddings.optim.update_rules import UpdateRule
from manualpar.embeddings.plan import EmbeddingPlan
from manualpar.embeddings.sharded.batch_inputs import BatchInputs, InputShape, PreparedBatch
from manualpar.embeddings.sharded.lookup import lookup
from manualpar.embeddings.sharded.managed_collisions import sharded_remapper
from manualpar.embeddings.sharded.remap_at_owner import remapped_at_owner
from manualpar.embeddings.sharded.table_hooks import TableHooks, full_tensor
from manualpar.embeddings.sharded.table_storage import table_blocks
from manualpar.embeddings.step.routing import Routing
from manualpar.embeddings.step.sharded_step import ShardedStep
from manualpar.embeddings.step.table_mesh import TableMesh, table_mesh
from manualpar.embeddings.storage.disk_tier import DiskTier
from manualpar.ownership import claim
from manualpar.phase_times import PhaseTimes

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["ShardedTables"]


class ShardedTables(TableRecords, nn.Module):
    """This rank's shards of a collection's tables, their fused optimizer (`fused_optimizer`)
    and the sharded step; `plan` and `configs` describe it:
    `print(emb.plan.describe(emb.configs))`. Built by `shard_embeddings`, as one of the two
    collections."""

    def __init__(
        self,
        source: EmbeddingBagCollection | EmbeddingCollection,
        strategy: ManualParallelStrategy,
        plan: EmbeddingPlan,
        rule: UpdateRule,
        normalize_by: str,
        layout: TableMesh | None,
        disk_tier: DiskTier | None,
        non_finite: str,
        *,
        shape: InputShape,
        step_normalize_by: str | None = None,
        compact_bags: bool = False,
        warn_uneven: bool = True,
    ) -> None:
        """`shape`: the bags a batch becomes; `step_normalize_by`: how the step weighs the
        ranks' bags (default: `normalize_by`); `compact_bags`: exchange only the bags with ids
        (step/exchange.py); `warn_uneven`: say once when the ranks' bag counts differ."""
        super().__init__()
        self.mesh = layout = layout or table_mesh(None, strategy)
        self.configs, self.seed, self.plan = source.configs, source.seed, plan
        self.strategy = strategy
        self.normalize_by = normalize_by
        self.routing = Routing(source.configs, plan, layout.shard_rank)
        self.feature_names = tuple(name for name, _ in self.routing.features)
        device = strategy.device
        self.blocks = table_blocks(source, self.routing, plan, rule, device, disk_tier)
        self.tables = self.blocks.tables
        self.storage = self.blocks.stores
        at_owner = remapped_at_owner(self.configs, plan, layout)
        self.raw_id_remap = sharded_remapper(self.configs, strategy, source.raw_id_remap, at_owner)
        claim(self, BUILDER, trains_itself=True)
        gather = full_tensor(strategy)
        self.fused_optimizer = FusedOptimizer(
            rule, self.blocks, gather, primary_replica=layout.primary, seed=source.seed
        )
        # a leaf that requires grad, so backward (a collective) runs on every rank, even one
        # that holds no table
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        names = [config.name for config in self.configs]
        remap = self.raw_id_remap
        self.step = ShardedStep(
            self.routing,
            self.blocks,
            self.fused_optimizer,
            strategy,
            step_normalize_by or normalize_by,
            device,
            layout,
            non_finite,
            compact_bags=compact_bags,
            owner_remap=None if remap is None else remap.owner_remap(names),
            warn_uneven=warn_uneven,
        )
        self.inputs = BatchInputs(shape, self.configs, remap, self.step, strategy, self.tables)
        self.hooks = TableHooks(self.blocks, layout.primary, gather, self.inputs.drop)

    def extra_repr(self) -> str:
        return f"{self.plan}, rule={self.fused_optimizer.rule.describe()}"

    def follow_replaced_weights(self) -> None:
        """A table weight replaced since the last step takes the old one's owner marks now, so
        `ParallelModule.dense_parameters()` leaves it out (the fused optimizer updates it)."""
        self.fused_optimizer.follow_tables()

    def lookup(self, batch: PreparedBatch) -> torch.Tensor:
        """The pooled values (bags, total dim) of a prepared batch; differentiable: its
        backward updates the tables."""
        return lookup(self._anchor, self.step, batch)

    # pipelining -------------------------------------------------------------------------------
    def prefetch(self, features: SparseFeatures) -> None:
        """Start this batch's input dist now, before the current batch's step (collective:
        every rank prefetches its own next batch): the checks, the hashing, the size exchange
        and the ids on their way to their owners. The forward of this very object takes them
        (batch_inputs.py; TrainPipeline calls this for you). Over a disk tier, the rows are read
        into the cache too. Raw ids of ManagedCollisions tables that need the remap exchange
        start travelling to their remappers instead, and the remap and the input dist wait for
        the forward (docs/embeddings-pipelining.md)."""
        self.inputs.prefetch(features)

    @property
    def batches_in_flight(self) -> int:
        """Prefetched batches whose forward has not come yet (0, 1 or 2)."""
        return self.inputs.holding

    def drop_prefetched(self) -> None:
        """Forget prefetched batches that will not be looked up (a disk tier's rows read in
        for them are unpinned)."""
        self.inputs.drop()

    # the Trainer's view -----------------------------------------------------------------------
    def checkpoint_entries(self) -> dict[str, Any]:
        """The fused optimizer's state is saved beside the model (see checkpoint.extra)."""
        return {"sparse_optim": self.fused_optimizer}

    @property
    def skipped_updates(self) -> int:
        """Backward passes whose sparse update was dropped for non-finite gradients (under
        shard_embeddings(..., non_finite="skip")); the Trainer skips the dense step then too.
        Updates undone with a dropped step (`undo_updates`) count too."""
        return self.step.skipped_updates

    @property
    def phase_times(self) -> PhaseTimes:
        """Seconds per phase of the steps while switched on: `emb.phase_times.start()`, steps,
        `emb.phase_times.stop()` (manualpar/phase_times.py; the Trainer's `step_times_every` sets
        one recorder shared with its own phases)."""
        return self.step.phase_times

    @phase_times.setter
    def phase_times(self, times: PhaseTimes) -> None:
        self.step.phase_times = times

    @property
    def non_finite(self) -> str:
        """What a non-finite output gradient does: "raise" or "skip" (shard_embeddings)."""
        return self.step.backward_phases.finite.mode

    def hold_updates(self) -> None:
        """Keep the sparse updates of the backwards from now on undoable, until
        `keep_updates()` or `undo_updates()` (the Trainer's step under "skip";
        step/update_journal.py: it costs a copy of the touched rows per backward)."""
        self.step.journal.open()

    def keep_updates(self) -> None:
        """The held updates stand."""
        self.step.journal.keep()

    def undo_updates(self) -> int:
        """Put back the rows, optimizer state and update count the held updates changed;
        counted in `skipped_updates`. Returns how many were undone."""
        undone = self.step.journal.undo()
        self.step.backward_phases.finite.skipped += undone
        return undone

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.step.dtype
