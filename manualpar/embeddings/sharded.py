"""shard_embeddings: split an EmbeddingBagCollection over the ranks, with a fused optimizer.

    emb = shard_embeddings(model.emb, strategy, plan="auto", optimizer=RowWiseAdagrad(lr=0.05))
    pooled = emb(features)            # (local batch, sum of dims); differentiable
    loss.backward()                   # the tables are updated here, inside backward

Gradient semantics, as DDP's: each rank's loss is over its local batch and a table's gradient is
the average over ranks (the gradient of the global-batch mean), so tables and DDP parts agree.
`normalize_by="global_samples"` weights each rank by its share of the global batch instead, as
`ddp(normalize_by="global_samples")`, for variable per-rank batches. Every rank must run forward
and backward the same number of times (each is a collective), as with DDP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from manualpar.embeddings.collection import (
    EmbeddingBagCollection,
    EmbeddingTable,
    PooledEmbeddings,
    check_features,
)
from manualpar.embeddings.exchange import (
    REFUSED,
    assemble_output,
    exchange_ids,
    grad_receive_splits,
    output_splits,
    pack_output_grad,
    split_output,
    unpack_output_grad,
)
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.fused_optimizer import FusedOptimizer
from manualpar.embeddings.kernels import pooled_sum, row_gradients
from manualpar.embeddings.local_shards import Block, LocalShards, gathering_full_tensors
from manualpar.embeddings.optimizers import SparseOptimizer
from manualpar.embeddings.plan import EmbeddingPlan, TablePlacement
from manualpar.embeddings.routing import Routing
from manualpar.embeddings.table_init import init_rows
from manualpar.errors import BuilderError, EmbeddingInputError, PlanError
from manualpar.wrappers.ownership import claim, mark_replaced

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["ShardedEmbeddingBagCollection", "fused_optimizers", "shard_embeddings"]

BUILDER = "shard_embeddings"
NORMALIZATIONS = ("world", "global_samples")


def shard_embeddings(
    ebc: EmbeddingBagCollection,
    strategy: ManualParallelStrategy,
    plan: EmbeddingPlan | Mapping[str, TablePlacement] | str = "auto",
    optimizer: SparseOptimizer | None = None,
    *,
    memory_budget_bytes: int | None = None,
    normalize_by: str = "world",
) -> ShardedEmbeddingBagCollection:
    """Shard `ebc` (meta or materialized) by `plan` and train it with the fused `optimizer`.

    `plan`: "auto" (the planner; `memory_budget_bytes` per rank), an EmbeddingPlan, or a
    mapping table name -> placement for this world size. Meta tables are initialized per shard
    with the values the unsharded collection would have; real tables are copied block by block.
    """
    if not isinstance(ebc, EmbeddingBagCollection):
        raise BuilderError(f"{BUILDER}() takes an EmbeddingBagCollection, got "
                           f"{type(ebc).__name__}")
    if optimizer is None:
        raise BuilderError(f"{BUILDER}(): pass optimizer=SGD/Adagrad/RowWiseAdagrad/Adam(lr=...);"
                           " sharded tables are updated by a fused optimizer inside backward")
    if normalize_by not in NORMALIZATIONS:
        raise BuilderError(f"{BUILDER}(): normalize_by must be one of {NORMALIZATIONS}, got "
                           f"{normalize_by!r}")
    if isinstance(plan, str):
        if plan != "auto":
            raise PlanError(f"plan must be 'auto', an EmbeddingPlan or a mapping, got {plan!r}")
        from manualpar.embeddings.planner import plan_tables

        plan = plan_tables(ebc.configs, strategy.world_size,
                           ranks_per_node=strategy.environment.local_world_size,
                           memory_budget_bytes=memory_budget_bytes, optimizer=optimizer)
    elif not isinstance(plan, EmbeddingPlan):
        plan = EmbeddingPlan(strategy.world_size, dict(plan))
    plan.validate(ebc.configs, strategy.world_size)
    claim(ebc, BUILDER)
    sharded = ShardedEmbeddingBagCollection(ebc, strategy, plan, optimizer, normalize_by)
    mark_replaced(ebc.parameters(), BUILDER)
    return sharded


class ShardedEmbeddingBagCollection(nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection, strategy: ManualParallelStrategy,
                 plan: EmbeddingPlan, optimizer: SparseOptimizer, normalize_by: str) -> None:
        super().__init__()
        self.configs = ebc.configs
        self.seed = ebc.seed
        self.plan = plan
        self.strategy = strategy
        self.normalize_by = normalize_by
        self.routing = Routing(ebc.configs, plan, strategy.rank)
        self.feature_names = tuple(name for name, _ in self.routing.features)
        device = strategy.device
        self.tables = nn.ModuleDict()
        shards = {}
        for t, config in enumerate(self.configs):
            shard = next((s for s in self.routing.local_shards if s.table == t), None)
            shards[config.name] = shard.shard if shard else None
            rows, cols = ((shard.shard.rows, shard.shard.cols) if shard
                          else (0, config.embedding_dim))
            table = EmbeddingTable(config, ebc.seed, rows, cols, device=device)
            if shard is not None:
                _fill_block(table.weight, ebc.tables[config.name].weight, config, ebc.seed,
                            shard.shard)
            table._register_state_dict_hook(self._table_state_dict)
            table._register_load_state_dict_pre_hook(self._table_load_pre_hook)
            self.tables[config.name] = table
        claim(self, BUILDER)
        self._shards = shards
        self.fused_optimizer = FusedOptimizer(
            optimizer, shards, {c.name: c.embedding_dim for c in self.configs},
            {c.name: c.num_embeddings for c in self.configs}, device, self._full_tensor)
        # a leaf that requires grad, so backward (a collective) runs on every rank, even one
        # that holds no table
        self._anchor = torch.zeros((), device=device, requires_grad=True)

    def extra_repr(self) -> str:
        return f"{self.plan}, optimizer={self.fused_optimizer.optimizer.describe()}"

    # forward ----------------------------------------------------------------------------------
    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        try:
            features = check_features(features, self.configs)
        except EmbeddingInputError:
            self._refuse_step()
            raise
        features = features.to(self.strategy.device)
        values = _EmbeddingLookup.apply(self._anchor, self, features)
        return PooledEmbeddings(values, self.feature_names, tuple(self.routing.dims))

    def _refuse_step(self) -> None:
        """Bad local batch: still join the size exchange, with REFUSED sizes, so the other
        ranks stop at this step with an error instead of waiting for the collective timeout."""
        world = self.strategy.world_size
        if world > 1:
            self._all_to_all(torch.full((3 * world,), REFUSED, device=self.strategy.device),
                             [3] * world, [3] * world, "ids")

    def _all_to_all(self, tensor: torch.Tensor, send: list[int], receive: list[int],
                    what: str) -> torch.Tensor:
        if self.strategy.world_size == 1:
            return tensor
        out = tensor.new_empty(sum(receive))
        with self.strategy._collective(f"{BUILDER}: {what} all_to_all"):
            torch.distributed.all_to_all_single(out, tensor.contiguous(), receive, send,
                                                group=self.strategy.group)
        return out

    def lookup(self, features: SparseFeatures) -> tuple[torch.Tensor, dict[str, Any]]:
        """Forward without autograd: pooled values and what backward needs."""
        routing = self.routing
        batch = features.batch_size
        sent, received = exchange_ids(
            routing, features.values, features.lengths, features.weights,
            lambda t, s, r: self._all_to_all(t, s, r, "ids"))
        local = routing.routed_local_shards()
        pooled = [pooled_sum(self.tables[self.configs[s.table].name].weight.detach(),
                             inp.ids, inp.lengths, inp.weights)
                  for s, inp in zip(local, received.shards, strict=True)]
        send, send_splits = split_output(routing, pooled, received.batch_sizes)
        back = self._all_to_all(send, send_splits, output_splits(routing, batch), "pooled output")
        out = assemble_output(routing, back, batch)
        # per-feature views are needed only by replicated tables (looked up locally)
        feature_ids = _split_features(features) if routing.data_parallel else []
        for f, (_, t) in enumerate(routing.features):
            if t in routing.data_parallel:
                ids, lengths, weights = feature_ids[f]
                weight = self.tables[self.configs[t].name].weight.detach()
                start = routing.feature_offsets[f]
                out[:, start:start + routing.dims[f]] = pooled_sum(weight, ids, lengths, weights)
        mean_scale = self._mean_scale(sent.lengths, out.dtype)
        if mean_scale is not None:
            out.mul_(mean_scale)
        return out, {"received": received, "sent": sent, "features": feature_ids,
                     "mean_scale": mean_scale}

    def _mean_scale(self, lengths: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """(batch, total_dim) factors 1/len for mean-pooled features, or None."""
        routing = self.routing
        means = [f for f, (_, t) in enumerate(routing.features)
                 if self.configs[t].pooling == "mean"]
        if not means:
            return None
        scale = torch.ones(lengths.shape[1], routing.total_dim, dtype=dtype,
                           device=lengths.device)
        for f in means:
            start = routing.feature_offsets[f]
            scale[:, start:start + routing.dims[f]] = 1 / lengths[f].clamp(min=1).to(
                dtype).unsqueeze(1)
        return scale

    # backward: gradient exchange and fused update ---------------------------------------------
    def apply_gradient(self, grad: torch.Tensor, saved: dict[str, Any]) -> None:
        routing, optimizer = self.routing, self.fused_optimizer
        rule = optimizer.optimizer
        optimizer.step += 1
        if saved["mean_scale"] is not None:
            grad = grad * saved["mean_scale"]
        received = saved["received"]
        batch_sizes = received.batch_sizes
        scales = self._sender_scales(batch_sizes)
        send, send_splits = pack_output_grad(routing, grad, rule.needs_full_rows)
        recv_splits = grad_receive_splits(routing, batch_sizes, rule.needs_full_rows)
        received_grad = self._all_to_all(send, send_splits, recv_splits, "output gradient")
        bag_grads = unpack_output_grad(routing, received_grad, batch_sizes, rule.needs_full_rows)
        uniform = bool((scales == scales[0]).all())
        local = routing.routed_local_shards()
        for shard, inp, grads in zip(local, received.shards, bag_grads, strict=True):
            if not uniform:
                per_bag = torch.repeat_interleave(scales, torch.tensor(
                    [len(shard.features) * b for b in batch_sizes]))
                grads = grads * per_bag.unsqueeze(1).to(device=grads.device, dtype=grads.dtype)
            self._update_from_bags(shard.table, shard.shard, inp, grads,
                                   float(scales[0]) if uniform else 1.0)
        if routing.data_parallel:
            self._update_data_parallel(grad, saved, scales[routing.rank])

    def _sender_scales(self, batch_sizes: list[int]) -> torch.Tensor:
        """Weight of each rank's loss in the table gradient (1/world, or its sample share)."""
        if self.normalize_by == "world":
            return torch.full((len(batch_sizes),), 1 / len(batch_sizes))
        total = sum(batch_sizes)
        return torch.tensor([b / total if total else 0.0 for b in batch_sizes])

    def _update_from_bags(self, t: int, shard: Any, inp: Any, bag_grads: torch.Tensor,
                          scale: float) -> None:
        """Update a shard from its bags' gradients: fused if the rule can, else per row."""
        name = self.configs[t].name
        optimizer = self.fused_optimizer
        with torch.no_grad():
            if optimizer.optimizer.step_bags(self.tables[name].weight, optimizer.state[name],
                                             inp.ids, inp.lengths, inp.weights, bag_grads,
                                             scale, shard.col_start, optimizer.step):
                return
        rows, summed = row_gradients(inp.ids, inp.lengths, inp.weights, bag_grads,
                                     shard.rows, scale)
        self._update(t, shard, rows, summed)

    def _update(self, t: int, shard: Any, rows: torch.Tensor, summed: torch.Tensor) -> None:
        config = self.configs[t]
        rule = self.fused_optimizer.optimizer
        row_sq_mean = summed.square().mean(1) if rule.needs_full_rows else None
        if summed.shape[1] != shard.cols:  # full-width gradient of a column block
            summed = summed[:, shard.col_start:shard.col_end]
        with torch.no_grad():
            rule.step_rows(self.tables[config.name].weight, self.fused_optimizer.state[
                config.name], rows, summed, self.fused_optimizer.step, row_sq_mean)

    def _update_data_parallel(self, grad: torch.Tensor, saved: dict[str, Any],
                              my_scale: torch.Tensor) -> None:
        """Replicated tables: sum dense row gradients and touch counts over ranks (one
        all_reduce for all of them; such tables are small by construction)."""
        routing = self.routing
        buffers = []
        for t in routing.data_parallel:
            config = self.configs[t]
            dense = grad.new_zeros(config.num_embeddings, config.embedding_dim + 1)
            for f, (_, ft) in enumerate(routing.features):
                if ft != t:
                    continue
                ids, lengths, weights = saved["features"][f]
                start = routing.feature_offsets[f]
                bag_grads = grad[:, start:start + config.embedding_dim] * my_scale
                rows, summed = row_gradients(ids, lengths, weights, bag_grads,
                                             config.num_embeddings)
                dense[rows, :-1] += summed
                dense[rows, -1] += 1
            buffers.append(dense)
        flat = torch.cat([b.flatten() for b in buffers])
        if self.strategy.world_size > 1:
            with self.strategy._collective(f"{BUILDER}: data-parallel gradient all_reduce"):
                torch.distributed.all_reduce(flat, group=self.strategy.group)
        offset = 0
        for t, buffer in zip(routing.data_parallel, buffers, strict=True):
            dense = flat[offset:offset + buffer.numel()].view_as(buffer)
            offset += buffer.numel()
            rows = torch.nonzero(dense[:, -1]).flatten()
            self._update(t, self._shards[self.configs[t].name], rows, dense[rows, :-1])

    # checkpoint -------------------------------------------------------------------------------
    def _table_block(self, table: EmbeddingTable) -> LocalShards:
        config = table.config
        shard = self._shards[config.name]
        shape = (config.num_embeddings, config.embedding_dim)
        if shard is None:
            return LocalShards(shape, [], table.weight.dtype)
        primary = not shard.replicated or shard.rank == 0
        return LocalShards(shape, [Block((shard.row_start, shard.col_start), table.weight.data,
                                         primary)], table.weight.dtype)

    def _full_tensor(self, shards: LocalShards) -> torch.Tensor:
        with self.strategy._collective(f"{BUILDER}: gathering a full table"):
            return shards.gather(self.strategy.group if self.strategy.world_size > 1 else None)

    def _table_state_dict(self, table: nn.Module, state_dict: dict, prefix: str,
                          local_metadata: Any) -> None:
        value = self._table_block(table)
        state_dict[prefix + "weight"] = (self._full_tensor(value) if gathering_full_tensors()
                                         else value)

    def _table_load_pre_hook(self, state_dict: dict, prefix: str, *args: Any) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            return
        name = prefix.rstrip(".").split(".")[-1]
        table = self.tables[name]
        value, mine = state_dict[key], self._table_block(table)
        if isinstance(value, LocalShards):
            if value.blocks and value.blocks[0].tensor.data_ptr() != table.weight.data_ptr():
                mine.blocks[0].tensor.copy_(value.blocks[0].tensor)
        else:
            mine.copy_from_full(value.to(table.weight.device), f"table {name!r}")
        state_dict[key] = table.weight.detach()


class _EmbeddingLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, module: ShardedEmbeddingBagCollection,
                features: SparseFeatures) -> torch.Tensor:
        out, saved = module.lookup(features)
        ctx.module, ctx.saved = module, saved
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.module.apply_gradient(grad.contiguous(), ctx.saved)
        ctx.saved = None
        return None, None, None


def _split_features(features: SparseFeatures) -> list[tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor | None]]:
    batch = features.batch_size
    sizes = features.feature_sizes()
    values = features.values.split(sizes)
    weights = features.weights.split(sizes) if features.weights is not None else [None] * len(
        sizes)
    return [(values[f], features.lengths[f * batch:(f + 1) * batch], weights[f])
            for f in range(len(sizes))]


def _fill_block(weight: nn.Parameter, source: torch.Tensor, config: Any, seed: int,
                shard: Any) -> None:
    """This rank's block: the source's values if it is real, else the seeded initial values."""
    with torch.no_grad():
        if source.is_meta:  # generated in place: no second copy of the block, even briefly
            init_rows(config, seed, (shard.row_start, shard.row_end),
                      (shard.col_start, shard.col_end), out=weight.detach())
        else:
            weight.copy_(source[shard.row_start:shard.row_end, shard.col_start:shard.col_end])



def fused_optimizers(model: nn.Module) -> dict[str, FusedOptimizer]:
    """Checkpoint entries for every sharded collection's fused optimizer in `model`.

    Keys: "sparse_optim" for a single collection, else "sparse_optim_<module path>".
    """
    found = {name: m.fused_optimizer for name, m in model.named_modules()
             if isinstance(m, ShardedEmbeddingBagCollection)}
    if len(found) == 1:
        return {"sparse_optim": next(iter(found.values()))}
    return {"sparse_optim_" + name.replace(".", "_"): opt for name, opt in found.items()}
