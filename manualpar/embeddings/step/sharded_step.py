"""ShardedStep: one sharded collection's step, in named phases bound to its routing.

    forward:  input_dist (ids to their owners) -> lookup -> output_dist (pooled rows back)
    backward: gradient_dist (output gradients to the owners) -> update (the fused rule)

`step.forward(features)` and `step.backward(grad, saved)` run them in order; each phase is also
a method of `step.forward_phases` / `step.backward_phases` taking the previous phase's result
(results.py), so a caller may run one batch's input phases while another computes. The
replicated tables (data_parallel.py), the replica combine of 2-D tables (row_sums.py) and the
table batch (batched_tables.py: many tables, one kernel call per phase) are parts of their own,
chosen once here. Frozen tables (frozen.py) are left out of backward.
Each phase times itself into `step.phase_times` while it is switched on (manualpar.phase_times).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.ids.remap import OwnerRemap
from manualpar.embeddings.optim.fused_optimizer import FusedOptimizer
from manualpar.embeddings.step.backward import BackwardPhases
from manualpar.embeddings.step.batched_tables import BatchedTables
from manualpar.embeddings.step.data_parallel import DataParallelTables
from manualpar.embeddings.step.exchange import ExchangeLayout
from manualpar.embeddings.step.forward import ForwardPhases
from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.results import RoutedIds, SavedForBackward
from manualpar.embeddings.step.routing import Routing
from manualpar.embeddings.step.table_mesh import TableMesh
from manualpar.embeddings.step.update_journal import UpdateJournal
from manualpar.embeddings.step.weight_guard import WeightGuard
from manualpar.embeddings.step.wire import WireDtypes
from manualpar.embeddings.storage.table_blocks import TableBlocks
from manualpar.phase_times import PhaseTimes

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["ShardedStep"]


class ShardedStep:
    def __init__(
        self,
        routing: Routing,
        blocks: TableBlocks,
        optimizer: FusedOptimizer,
        strategy: ManualParallelStrategy,
        normalize_by: str,
        device: torch.device,
        mesh: TableMesh,
        non_finite: str = "raise",
        compact_bags: bool = False,
        owner_remap: OwnerRemap | None = None,
        warn_uneven: bool = True,
    ) -> None:
        self.parts = StepParts(
            routing,
            ExchangeLayout(routing, compact_bags, owner_remap),
            blocks.tables,
            optimizer,
            blocks.stores,
            strategy,
            normalize_by,
            device,
            mesh,
            owner_remap,
        )
        data_parallel = DataParallelTables(self.parts)
        held = [block.name for block in blocks.held()]
        job_rank = mesh.group_ranks[mesh.shard_rank]
        cached = [name for name in held if blocks.stores.by_name[name].reads_rows]
        guard = WeightGuard(blocks.tables, held, job_rank, optimizer.weights_replaced, cached)
        batched = BatchedTables(self.parts, guard)
        self.forward_phases = ForwardPhases(self.parts, data_parallel, batched, warn_uneven)
        self.backward_phases = BackwardPhases(self.parts, data_parallel, non_finite, batched)
        self.phase_times = PhaseTimes(device)
        self.wire = WireDtypes()

    def use_wire(self, wire: WireDtypes) -> None:
        """Send the pooled outputs and output gradients in `wire`'s dtypes (wire.py)."""
        self.wire = wire
        self.forward_phases.wire = wire.forward
        self.backward_phases.wire = wire.backward

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.dtype

    @property
    def batches_tables(self) -> bool | None:
        """Whether steps look up and update all of this rank's tables in one kernel call each
        (batched_tables.py; the same bits either way): None (the default) where a step's
        tables are small (many small tables: faster; large ones: slower; docs/benchmarks.md,
        "Many small tables"), True wherever they can, False never."""
        return self.forward_phases.batched.enabled

    @batches_tables.setter
    def batches_tables(self, value: bool | None) -> None:
        self.forward_phases.batched.enabled = value

    @property
    def skipped_updates(self) -> int:
        """Backward passes whose sparse update non_finite="skip" dropped (finite_check.py)."""
        return self.backward_phases.finite.skipped

    @property
    def phase_times(self) -> PhaseTimes:
        """The recorder the phases time themselves into (off unless started); a loop may set
        its own, shared with its other phases."""
        return self.forward_phases.times

    @phase_times.setter
    def phase_times(self, times: PhaseTimes) -> None:
        self.forward_phases.times = self.backward_phases.times = times

    @property
    def journal(self) -> UpdateJournal:
        """The undo journal of the Trainer's open step (update_journal.py)."""
        return self.backward_phases.journal

    def forward(
        self, features: SparseFeatures, routed: RoutedIds | None = None
    ) -> tuple[torch.Tensor, SavedForBackward]:
        """Pooled values (batch, total dim) of this rank's batch, and what backward needs;
        `routed`: the batch's input dist, if it ran ahead (a pipeline's prefetch)."""
        phases = self.forward_phases
        if routed is None:
            return phases(features)
        return phases.output_dist(phases.lookup(routed))

    def backward(self, grad: torch.Tensor, saved: SavedForBackward) -> None:
        """Update this rank's shards from the output gradient of every rank's batch."""
        self.backward_phases(grad, saved)

    def release(self, saved: SavedForBackward) -> None:
        """A forward that no backward will follow (no grad, or every table frozen): unpin its
        slots."""
        self.parts.stores.release(saved.pins, updated=False)

    def refuse(self) -> None:
        """This rank's batch failed validation: join the size exchange with REFUSED sizes, so
        the other ranks stop at this step with an error instead of waiting for a timeout."""
        self.forward_phases.ids_exchange.refuse()
