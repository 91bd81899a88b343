"""ShardedEmbeddingBagCollection: this rank's blocks of the tables, their fused optimizer and
the sharded step (step/) that looks them up in forward and updates them in backward.

Built by `shard_embeddings` (sharded/shard_embeddings.py). The tables' state dict holds each
rank's blocks as LocalShards, so a checkpoint reshards on load to any plan or world size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from manualpar.checkpoint.local_shards import Block, LocalShards, gathering_full_tensors
from manualpar.eager import eager_only
from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.ids.hashing import hash_raw_ids
from manualpar.embeddings.modules.bag_collection import (
    EmbeddingBagCollection,
    EmbeddingTable,
    PooledEmbeddings,
    check_features,
    table_of,
)
from manualpar.embeddings.modules.sequence_collection import EmbeddingCollection
from manualpar.embeddings.modules.table_init import init_rows
from manualpar.embeddings.modules.table_record import TableRecords
from manualpar.embeddings.optim.fused_optimizer import FusedOptimizer
from manualpar.embeddings.optim.update_rules import SparseOptimizer
from manualpar.embeddings.plan import EmbeddingPlan
from manualpar.embeddings.sharded.in_flight import InFlight
from manualpar.embeddings.sharded.managed_collisions import (
    RemapInFlight,
    remapped_at_owner,
    sharded_remapper,
)
from manualpar.embeddings.sharded.table_storage import cache_slots, table_stores
from manualpar.embeddings.step.phase_times import IDS_EXCHANGE, PhaseTimes
from manualpar.embeddings.step.results import RoutedIds
from manualpar.embeddings.step.routing import Routing
from manualpar.embeddings.step.sharded_step import ShardedStep
from manualpar.embeddings.step.table_mesh import TableMesh, table_mesh
from manualpar.embeddings.storage.disk_tier import DiskTier
from manualpar.errors import EmbeddingInputError
from manualpar.ownership import claim

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["ShardedEmbeddingBagCollection"]


class ShardedEmbeddingBagCollection(TableRecords, nn.Module):
    """What `shard_embeddings` returns for an EmbeddingBagCollection: this rank's shards, the
    sharded step (forward returns PooledEmbeddings) and `fused_optimizer`; build it through
    `shard_embeddings`, not directly. `plan` and `configs` describe it:
    `print(emb.plan.describe(emb.configs))`. Its checkpoint record (TableRecords) refuses a
    checkpoint of tables with other rows, dim or raw-id setting."""

    def __init__(
        self,
        ebc: EmbeddingBagCollection | EmbeddingCollection,
        strategy: ManualParallelStrategy,
        plan: EmbeddingPlan,
        optimizer: SparseOptimizer,
        normalize_by: str,
        layout: TableMesh | None = None,
        disk_tier: DiskTier | None = None,
        non_finite: str = "raise",
    ) -> None:
        super().__init__()
        self.mesh = layout = layout or table_mesh(None, strategy)
        self.configs = ebc.configs
        self.seed = ebc.seed
        self.plan = plan
        self.strategy = strategy
        self.normalize_by = normalize_by
        self.routing = Routing(ebc.configs, plan, layout.shard_rank)
        self.feature_names = tuple(name for name, _ in self.routing.features)
        device = strategy.device
        self.tables = nn.ModuleDict()
        shards = {}
        for t, config in enumerate(self.configs):
            shard = next((s for s in self.routing.local_shards if s.table == t), None)
            shards[config.name] = shard.shard if shard else None
        slots = cache_slots(self.configs, plan, shards, optimizer, disk_tier)
        for config in self.configs:
            shard_of = shards[config.name]
            rows, cols = (
                (slots.get(config.name, shard_of.rows), shard_of.cols)
                if shard_of
                else (0, config.embedding_dim)
            )
            table = EmbeddingTable(config, ebc.seed, rows, cols, device=device)
            source = table_of(ebc.tables, config.name).weight
            table.weight.requires_grad_(source.requires_grad)  # frozen before sharding stays so
            if shard_of is not None and config.name not in slots:
                _fill_block(table.weight, source, config, ebc.seed, shard_of)
            table._register_state_dict_hook(self._table_state_dict)
            table._register_load_state_dict_pre_hook(self._table_load_pre_hook)
            self.tables[config.name] = table
        self.raw_id_remap = sharded_remapper(
            self.configs, strategy, ebc.raw_id_remap, remapped_at_owner(self.configs, plan, layout)
        )
        claim(self, BUILDER, trains_itself=True)
        self._shards = shards
        self.fused_optimizer = FusedOptimizer(
            optimizer,
            {c.name: table_of(self.tables, c.name).weight for c in self.configs},
            shards,
            {c.name: c.embedding_dim for c in self.configs},
            {c.name: c.num_embeddings for c in self.configs},
            device,
            self._full_tensor,
            primary_replica=layout.primary,
            seed=ebc.seed,
            block_rows=slots,
        )
        self.storage = table_stores(
            self.configs,
            self.seed,
            self.tables,
            self.fused_optimizer.table_state,
            layout.shard_rank,
            ebc,
            shards,
            slots,
            disk_tier,
            optimizer,
        )
        self.fused_optimizer.stores.update(self.storage.by_name)
        # a leaf that requires grad, so backward (a collective) runs on every rank, even one
        # that holds no table
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.step = ShardedStep(
            self.routing,
            self.tables,
            self.fused_optimizer,
            self.storage,
            strategy,
            normalize_by,
            device,
            layout,
            non_finite,
            # a sequence collection's bags hold one id each: exchange only those with ids
            compact_bags=isinstance(ebc, EmbeddingCollection),
            owner_remap=None
            if self.raw_id_remap is None
            else self.raw_id_remap.owner_remap([c.name for c in self.configs]),
        )
        self._in_flight = InFlight(self.tables, [c.name for c in self.configs])

    def extra_repr(self) -> str:
        return f"{self.plan}, optimizer={self.fused_optimizer.rule.describe()}"

    # forward ----------------------------------------------------------------------------------
    # A deliberate graph break under torch.compile: the lookup runs eagerly between compiled
    # dense graphs. Its exchange sizes are known only at run time (host syncs, no CUDA graph
    # capture either way) and its backward updates tables in place, which an opaque custom op
    # would have to hide from the compiler (docs/embeddings-training.md, "torch.compile").
    @eager_only(f"{BUILDER}: the table exchange runs eagerly")
    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        taken = self._in_flight.take(features)  # this very batch's ids, if prefetched
        routed = taken[0] if taken is not None else None
        with self.phase_times.phase(IDS_EXCHANGE):  # the input dist's preparation
            if isinstance(routed, RemapInFlight):  # raw ids sent ahead: remap them now
                features, routed = self._remapped(routed), None
            elif routed is None:
                features = self._checked(features)
                if self.raw_id_remap is not None:  # ManagedCollisions tables: raw ids to rows
                    features = self.raw_id_remap(features)
            else:
                features = routed.features
        return PooledEmbeddings(
            self._lookup(features, routed), self.feature_names, tuple(self.routing.dims)
        )

    def _remapped(self, sent: RemapInFlight) -> SparseFeatures:
        """A prefetched batch's rows: its raw ids travelled to their remappers a step ago."""
        assert self.raw_id_remap is not None
        return self.raw_id_remap.finish(sent)

    def _lookup(self, features: SparseFeatures, routed: RoutedIds | None) -> torch.Tensor:
        """The pooled values of checked, row-id `features` (from `routed` if prefetched)."""
        grad = torch.is_grad_enabled()
        return _EmbeddingLookup.apply(self._anchor, self, features, routed, grad)

    def _checked(self, features: SparseFeatures) -> SparseFeatures:
        """Checked against the tables (a bad batch stops every rank), on the device, hashed."""
        try:
            features = check_features(features, self.configs)
        except EmbeddingInputError:
            self._refuse_step()
            raise
        return hash_raw_ids(features.to(self.strategy.device), self.configs)

    def prefetch(self, features: SparseFeatures) -> None:
        """Start this batch's input dist now, before the current batch's step (collective:
        every rank prefetches its own next batch): the checks, the hashing, the size exchange
        and the ids on their way to their owners. The forward of this very object takes them
        (sharded/in_flight.py; TrainPipeline calls this for you). Over a disk tier, the rows
        are read into the cache too. ManagedCollisions tables held by rows travel as raw ids,
        remapped by their owners at the lookup; with tables that need the remap exchange, the
        raw ids start travelling to their remappers instead, and the remap and the input dist
        wait for the forward: a remap run early would put the remapper's state, and so a
        checkpoint, a batch ahead (docs/embeddings-pipelining.md)."""
        self._in_flight.check_free()
        with self.phase_times.phase(IDS_EXCHANGE):  # the input dist's preparation
            checked = self._checked(features)
            if self.raw_id_remap is not None and self.raw_id_remap.exchanges:
                self._in_flight.hold(features, self.raw_id_remap.send(checked))
                return
        self._hold(features, checked)

    def _hold(self, key: SparseFeatures, prepared: SparseFeatures, extra: Any = None) -> None:
        """Start the batch's input dist and, over a disk tier, read its rows in (pinned)."""
        self._in_flight.check_free()
        phases = self.step.forward_phases
        self._in_flight.hold(key, phases.fetch(phases.input_dist(prepared)), extra)

    @property
    def batches_in_flight(self) -> int:
        """Prefetched batches whose forward has not come yet (0, 1 or 2)."""
        return self._in_flight.holding

    def drop_prefetched(self) -> None:
        """Forget prefetched batches that will not be looked up (a disk tier's rows read in
        for them are unpinned)."""
        self._in_flight.drop()

    def _refuse_step(self) -> None:
        """Bad local batch: still join the size exchange, with REFUSED sizes, so the other
        ranks stop at this step with an error instead of waiting for the collective timeout."""
        remap = self.raw_id_remap
        if remap is not None and remap.exchanges:  # its exchange runs first: the others stop there
            remap.refuse()
            return
        if self.strategy.world_size > 1:
            self.step.refuse()

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
        `emb.phase_times.stop()` (step/phase_times.py; the Trainer's `step_times_every` sets
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

    # checkpoint -------------------------------------------------------------------------------
    def _table_block(self, table: EmbeddingTable) -> LocalShards:
        config = table.config
        shard = self._shards[config.name]
        shape = (config.num_embeddings, config.embedding_dim)
        if shard is None:
            return LocalShards(shape, [], table.weight.dtype)
        primary = self.mesh.primary and (not shard.replicated or shard.rank == 0)
        store = self.storage.by_name[config.name]
        chunks = store.checkpoint_chunks(None)  # a disk tier's: of its file, one at a time
        return LocalShards(
            shape,
            [
                Block(
                    (shard.row_start + r, shard.col_start),
                    t,
                    primary,
                    store.drop_pages,
                    store.spill_dir,
                )
                for r, t in chunks
            ],
            table.weight.dtype,
        )

    def _full_tensor(self, shards: LocalShards) -> torch.Tensor:
        return self.strategy.all_reduce_(
            shards.primary_sum(), "sum", name=f"{BUILDER}: gathering a full table"
        )

    def _table_state_dict(
        self, table: nn.Module, state_dict: dict, prefix: str, local_metadata: Any
    ) -> None:
        assert isinstance(table, EmbeddingTable)
        value = self._table_block(table)
        state_dict[prefix + "weight"] = (
            self._full_tensor(value) if gathering_full_tensors() else value
        )

    def _table_load_pre_hook(self, state_dict: dict, prefix: str, *args: Any) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            return
        name = prefix.rstrip(".").split(".")[-1]
        table = table_of(self.tables, name)
        value, mine = state_dict[key], self._table_block(table)
        if isinstance(value, LocalShards):
            for block, theirs in zip(mine.blocks, value.blocks, strict=False):
                if theirs.tensor.data_ptr() != block.tensor.data_ptr():
                    block.tensor.copy_(theirs.tensor)
        else:
            mine.copy_from_full(value.to(table.weight.device), f"table {name!r}")
        if name in self.storage.by_name:
            # batches sent ahead hold rows read before the load: forget them (their forward
            # then runs whole, on the loaded rows); the first disk table's load does it
            if self.batches_in_flight:
                self.drop_prefetched()
            self.storage.by_name[name].loaded([None])  # the weights
        state_dict[key] = table.weight.detach()


class _EmbeddingLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        module: ShardedEmbeddingBagCollection,
        features: SparseFeatures,
        routed: RoutedIds | None,
        grad_enabled: bool,
    ) -> torch.Tensor:
        out, saved = module.step.forward(features, routed)
        ctx.step, ctx.saved = module.step, saved
        if not (saved.trains and grad_enabled):  # no backward will unpin its rows
            module.step.release(saved)
        if not saved.trains:  # every table frozen: no backward, on every rank
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None, None]:
        # an empty batch's gradient may be an expanded (stride 0) tensor, which contiguous()
        # keeps as it is (it holds no element): the kernels need real row strides
        grad = grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)
        ctx.step.backward(grad, ctx.saved)
        ctx.saved = None
        return None, None, None, None, None


def _fill_block(
    weight: nn.Parameter, source: torch.Tensor, config: Any, seed: int, shard: Any
) -> None:
    """This rank's block: the source's values if it is real, else the seeded initial values."""
    with torch.no_grad():
        if source.is_meta:  # generated in place: no second copy of the block, even briefly
            init_rows(
                config,
                seed,
                (shard.row_start, shard.row_end),
                (shard.col_start, shard.col_end),
                out=weight.detach(),
            )
        else:
            weight.copy_(source[shard.row_start : shard.row_end, shard.col_start : shard.col_end])
