"""One step of a sharded collection: lookups in forward, the fused update in backward.

Each exchange (exchange.py) runs asynchronously and the compute that does not need it runs
meanwhile: in forward, this rank's own bags are looked up while the other ranks' ids travel, and
the rows of every shard are grouped for backward while the pooled rows travel; in backward, the
rows that only this rank's own bags touch are updated while the other ranks' gradients travel.
Every row is still updated once, with its whole gradient, so the numbers are those of a
sequential step. Frozen tables (frozen.py) are left out of backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.kernels.bags import (
    BagGradients,
    RowPass,
    ShardBags,
    group_rows,
    pooled_sum,
    row_gradients,
)
from manualpar.embeddings.kernels.rounding import accumulation_dtype
from manualpar.embeddings.modules.bag_collection import table_of
from manualpar.embeddings.optim.fused_optimizer import FusedOptimizer
from manualpar.embeddings.step.exchange import (
    SenderBags,
    add_block,
    check_refusals,
    combine_senders,
    grad_blocks,
    grad_receive_splits,
    header_width,
    output_splits,
    own_grad_blocks,
    pack_ids,
    pack_output_grad,
    pack_pooled,
    pooled_blocks,
    size_header,
    unpack_ids,
)
from manualpar.embeddings.step.frozen import agreed_frozen, encode, frozen_tables
from manualpar.embeddings.step.replica_combine import RowGradients, combine_replicas
from manualpar.embeddings.step.routing import LocalShard, Routing
from manualpar.embeddings.step.table_mesh import TableMesh
from manualpar.embeddings.storage.disk_tier import DiskTables

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy, PendingCollective

__all__ = ["LookupContext", "apply_gradient", "lookup", "sender_scales"]


@dataclass
class LookupContext:
    """What a sharded collection's forward and backward need, built once by the module: the
    routing of its plan, this rank's blocks, the fused optimizer and the strategy that carries
    the exchanges."""

    routing: Routing
    tables: nn.ModuleDict  # this rank's block of each table, by table name
    optimizer: FusedOptimizer
    strategy: ManualParallelStrategy
    normalize_by: str
    device: torch.device
    mesh: TableMesh  # the shard group the exchanges run in, and the replicas
    disk: DiskTables = field(default_factory=DiskTables)  # tables on disk: ids become slots

    def name(self, table: int) -> str:
        return self.routing.tables[table].name

    def weight(self, table: int) -> torch.Tensor:
        """This rank's block of table `table` (detached: the update is the fused optimizer's)."""
        return table_of(self.tables, self.name(table)).weight.detach()

    @property
    def dtype(self) -> torch.dtype:
        """The pooled output's dtype: float32 for half rows (rounding.accumulation_dtype)."""
        return accumulation_dtype(self.weight(0).dtype)

    def block_rows(self, shard: LocalShard) -> int:
        """Rows of this rank's block of the shard's table (its cache's slots if on disk)."""
        return self.weight(shard.table).shape[0]

    def table_names(self) -> list[str]:
        return [config.name for config in self.routing.tables]

    @property
    def fuses_bags(self) -> bool:
        """Whether the rule's fused pass runs: not when replicas must first sum row gradients
        (2-D tables take the row-sum path, as global clipping does)."""
        return self.optimizer.fuses_bags and not self.mesh.combines

    def exchange(
        self, tensor: torch.Tensor, send: list[int], receive: list[int], what: str
    ) -> PendingCollective:
        """Start one all_to_all of the step inside the shard group (elements per rank of the
        group); errors name `what`."""
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


# forward ---------------------------------------------------------------------------------------
def lookup(
    ctx: LookupContext,
    features: SparseFeatures,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Pooled values (batch, total dim) of this rank's batch, and what backward needs."""
    routing = ctx.routing
    rank, world = routing.rank, routing.world_size
    batch = features.batch_size
    lengths = features.lengths.view(len(routing.features), batch)
    sizes, parts, ids_in, frozen, job_batches = _send_ids(ctx, features, lengths)
    local = routing.routed_local_shards()
    pins: list[tuple[int, torch.Tensor]] = []  # disk tables' slots, pinned until backward
    if ctx.disk:
        ctx.disk.begin_step()
        parts[rank] = ctx.disk.to_slots(local, parts[rank], pins)
    out = torch.zeros(batch, routing.total_dim, dtype=ctx.dtype, device=ctx.device)
    _add_own_pooled(ctx, parts[rank], out, batch)  # while the other ranks' ids travel
    _unpack_others(routing, ids_in.wait(), sizes, parts)
    if ctx.disk:
        for sender in range(world):
            if sender != rank:
                parts[sender] = ctx.disk.to_slots(local, parts[sender], pins)
    pooled_in = _send_pooled(ctx, parts, out) if world > 1 else None
    bags = [combine_senders([parts[s][k] for s in range(world)], rank) for k in range(len(local))]
    if ctx.fuses_bags:  # while the pooled rows travel
        for shard, shard_bags in zip(local, bags, strict=True):
            if shard.table not in frozen:
                shard_bags.groups = group_rows(shard_bags, ctx.block_rows(shard))
    if pooled_in is not None:
        _add_received_pooled(routing, pooled_in.wait(), output_splits(routing, batch), out, batch)
    feature_ids = _lookup_data_parallel(ctx, features, out)
    mean_scale = _mean_scale(ctx, lengths, out.dtype)
    if mean_scale is not None:
        out.mul_(mean_scale)
    return out, {
        "bags": bags,
        "batch_sizes": [size[0] for size in sizes],
        "scales": sender_scales(ctx.normalize_by, [size[0] for size in sizes], job_batches),
        "features": feature_ids,
        "mean_scale": mean_scale,
        "frozen": frozen,
        "trains": len(frozen) < len(routing.tables),  # else no backward
        "pins": pins,
    }


def _send_ids(
    ctx: LookupContext,
    features: SparseFeatures,
    lengths: torch.Tensor,
) -> tuple[list[list[int]], list[list[SenderBags]], PendingCollective, frozenset[int], list[int]]:
    """Exchange sizes (blocking), then send the ids (in flight on return). Returns every
    group rank's [batch, payload length, weighted], the bags per sender rank and local shard
    (only this rank's own filled yet), the pending exchange, the frozen tables (agreed) and
    every job rank's batch size."""
    routing = ctx.routing
    rank, world = routing.rank, routing.world_size
    weighted = features.weights is not None
    payloads = pack_ids(routing, features.values, lengths, features.weights)
    names = ctx.table_names()
    flags = encode(frozen_tables(ctx.tables, names), len(names))
    header = size_header(features.batch_size, payloads, weighted, flags)
    width = header_width(len(names))
    headers = ctx.exchange_headers(header, width)
    check_refusals(headers)
    frozen = agreed_frozen([h[3:] for h in headers], names)
    sizes = [headers[g][:3] for g in ctx.mesh.group_ranks]
    others = [p for d, p in enumerate(payloads) if d != rank]
    pending = ctx.exchange(
        torch.cat(others) if others else payloads[rank][:0],
        [0 if d == rank else p.numel() for d, p in enumerate(payloads)],
        [0 if s == rank else size[1] for s, size in enumerate(sizes)],
        "ids",
    )
    parts: list[list[SenderBags]] = [[] for _ in range(world)]
    parts[rank] = unpack_ids(routing, payloads[rank], features.batch_size, weighted)
    return sizes, parts, pending, frozen, [h[0] for h in headers]


def _unpack_others(
    routing: Routing, received: torch.Tensor, sizes: list[list[int]], parts: list[list[SenderBags]]
) -> None:
    offset = 0
    for sender, (batch, length, weighted) in enumerate(sizes):
        if sender != routing.rank:
            parts[sender] = unpack_ids(
                routing, received[offset : offset + length], batch, bool(weighted)
            )
            offset += length


def _add_own_pooled(
    ctx: LookupContext, own: list[SenderBags], out: torch.Tensor, batch: int
) -> None:
    """Look up this rank's own bags in its own shards, straight into the output."""
    routing = ctx.routing
    routes = iter(routing.routes_to[routing.rank])
    for shard, bags in zip(routing.routed_local_shards(), own, strict=True):
        pooled = pooled_sum(ctx.weight(shard.table), *bags)
        for block in pooled.view(len(shard.features), batch, pooled.shape[1]):
            add_block(routing, out, next(routes), block)


def _send_pooled(
    ctx: LookupContext, parts: list[list[SenderBags]], out: torch.Tensor
) -> PendingCollective:
    """Look up the other ranks' bags and send them their pooled rows (in flight on return;
    `out`, this rank's output, gives the batch size, dtype and device)."""
    routing = ctx.routing
    local = routing.routed_local_shards()
    pooled = [
        None
        if s == routing.rank
        else [
            pooled_sum(ctx.weight(shard.table), *bags)
            for shard, bags in zip(local, parts[s], strict=True)
        ]
        for s in range(routing.world_size)
    ]
    flat, splits = pack_pooled(pooled, like=out)
    return ctx.exchange(flat, splits, output_splits(routing, out.shape[0]), "pooled output")


def _add_received_pooled(
    routing: Routing, received: torch.Tensor, splits: list[int], out: torch.Tensor, batch: int
) -> None:
    offset = 0
    for owner, size in enumerate(splits):
        if size:
            for route, block in pooled_blocks(
                routing, owner, received[offset : offset + size], batch
            ):
                add_block(routing, out, route, block)
        offset += size


def _lookup_data_parallel(ctx: LookupContext, features: SparseFeatures, out: torch.Tensor) -> list:
    """Replicated tables are looked up locally; returns per-feature (ids, lengths, weights)."""
    routing = ctx.routing
    if not routing.data_parallel:
        return []
    feature_ids = split_features(features)
    for f, (_, t) in enumerate(routing.features):
        if t in routing.data_parallel:
            ids, lengths, weights = feature_ids[f]
            weight = ctx.weight(t)
            start = routing.feature_offsets[f]
            out[:, start : start + routing.dims[f]] = pooled_sum(weight, ids, lengths, weights)
    return feature_ids


def _mean_scale(
    ctx: LookupContext, lengths: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """(batch, total_dim) factors 1/len for mean-pooled features, or None."""
    routing = ctx.routing
    means = [
        f for f, (_, t) in enumerate(routing.features) if ctx.routing.tables[t].pooling == "mean"
    ]
    if not means:
        return None
    scale = torch.ones(lengths.shape[1], routing.total_dim, dtype=dtype, device=lengths.device)
    for f in means:
        start = routing.feature_offsets[f]
        scale[:, start : start + routing.dims[f]] = 1 / lengths[f].clamp(min=1).to(dtype).unsqueeze(
            1
        )
    return scale


def split_features(
    features: SparseFeatures,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    batch = features.batch_size
    sizes = features.feature_sizes()
    values = features.values.split(sizes)
    weights = features.weights.split(sizes) if features.weights is not None else [None] * len(sizes)
    return [
        (values[f], features.lengths[f * batch : (f + 1) * batch], weights[f])
        for f in range(len(sizes))
    ]


# backward --------------------------------------------------------------------------------------
def apply_gradient(ctx: LookupContext, grad: torch.Tensor, saved: dict[str, Any]) -> None:
    """Send the output gradient to the shards' owners and update our shards with theirs
    (frozen tables: neither)."""
    routing, optimizer = ctx.routing, ctx.optimizer
    full = optimizer.needs_full_rows
    frozen = saved["frozen"]
    optimizer.begin_update()
    if saved["mean_scale"] is not None:
        grad = grad * saved["mean_scale"]
    batch_sizes, scales = saved["batch_sizes"], saved["scales"]
    routed = {route.table for routes in routing.routes_to for route in routes}
    grads_in = None
    if not routed <= frozen:  # every rank agrees: frozen is the same everywhere
        flat, splits = pack_output_grad(routing, grad, full, frozen)
        receive = grad_receive_splits(routing, batch_sizes, full, frozen)
        grads_in = ctx.exchange(flat, splits, receive, "output gradient")
    local, all_bags = routing.routed_local_shards(), saved["bags"]
    own = own_grad_blocks(routing, grad, full, frozen)
    own_scale = scales[routing.rank]
    alone = routing.world_size == 1
    combining = ctx.mesh.combines
    # while the other ranks' gradients travel: rows only our own bags touched
    fused = [
        shard.table not in frozen
        and not combining
        and _step_bags(
            ctx,
            shard,
            bags,
            BagGradients(blocks, [own_scale] * len(blocks)),
            RowPass.ALL if alone else RowPass.OWN,
        )
        for shard, bags, blocks in zip(local, all_bags, own, strict=True)
    ]
    others = (
        grad_blocks(routing, grads_in.wait(), batch_sizes, full, frozen)
        if grads_in is not None
        else []
    )
    summed_rows: list[tuple[LocalShard, RowGradients]] = []
    for k, (shard, bags) in enumerate(zip(local, all_bags, strict=True)):
        if shard.table in frozen:
            continue
        grads = BagGradients([], [])
        for sender, scale in enumerate(scales):  # bag order: every sender's, in rank order
            other = others[k][sender]
            blocks = own[k] if other is None else [other]
            grads.blocks += blocks
            grads.scales += [scale] * len(blocks)
        if not fused[k]:
            bag_grads, scale = grads.dense()
            rows, summed = row_gradients(
                bags.ids, bags.lengths, bags.weights, bag_grads, ctx.block_rows(shard), scale
            )
            summed_rows.append((shard, (rows, summed)))
        elif not alone:
            _step_bags(ctx, shard, bags, grads, RowPass.REST)
    _update_summed_rows(ctx, summed_rows)
    if not set(routing.data_parallel) <= frozen:
        _update_data_parallel(ctx, grad, saved, own_scale, frozen)
    optimizer.finish_update(ctx.strategy, group=ctx.mesh.shard)
    ctx.disk.release(saved["pins"], updated=True)  # written through the cache: dirty


def _update_summed_rows(ctx: LookupContext, updates: list[tuple[LocalShard, RowGradients]]) -> None:
    """Apply the row sums; with replicas, summed over the replicas first (replica_combine.py)."""
    parts = [part for _, part in updates]
    if ctx.mesh.replicate is not None and ctx.mesh.combines:
        parts = combine_replicas(ctx.strategy, ctx.mesh.replicate, parts)
    for (shard, _), (rows, summed) in zip(updates, parts, strict=True):
        ctx.optimizer.update_rows(ctx.name(shard.table), ctx.weight(shard.table), rows, summed)


def sender_scales(
    normalize_by: str, batch_sizes: list[int], job_batch_sizes: list[int] | None = None
) -> list[float]:
    """Weight of each sender's loss in the table gradient: 1 / (ranks of the job), or its
    share of the job's samples. `job_batch_sizes`: every job rank's batch (default: the
    senders are the whole job)."""
    job = batch_sizes if job_batch_sizes is None else job_batch_sizes
    if normalize_by == "world_size":
        return [1 / len(job)] * len(batch_sizes)
    total = sum(job)
    return [b / total if total else 0.0 for b in batch_sizes]


def _step_bags(
    ctx: LookupContext, shard: LocalShard, bags: ShardBags, grads: BagGradients, rows: RowPass
) -> bool:
    return ctx.optimizer.step_bags(
        ctx.name(shard.table), ctx.weight(shard.table), bags, grads, rows
    )


def _update_data_parallel(
    ctx: LookupContext,
    grad: torch.Tensor,
    saved: dict[str, Any],
    my_scale: float,
    frozen: frozenset[int],
) -> None:
    """Replicated tables not frozen: sum dense row gradients and touch counts over ranks (one
    all_reduce for all of them; such tables are small by construction)."""
    routing = ctx.routing
    tables = [t for t in routing.data_parallel if t not in frozen]
    buffers = []
    for t in tables:
        config = ctx.routing.tables[t]
        dense = grad.new_zeros(config.num_embeddings, config.embedding_dim + 1)
        for f, (_, ft) in enumerate(routing.features):
            if ft != t:
                continue
            ids, lengths, weights = saved["features"][f]
            start = routing.feature_offsets[f]
            bag_grads = grad[:, start : start + config.embedding_dim] * my_scale
            rows, summed = row_gradients(ids, lengths, weights, bag_grads, config.num_embeddings)
            dense[rows, :-1] += summed
            dense[rows, -1] += 1
        buffers.append(dense)
    flat = torch.cat([b.flatten() for b in buffers])
    ctx.strategy.all_reduce_(flat, "sum", name=f"{BUILDER}: data-parallel gradient all_reduce")
    offset = 0
    for t, buffer in zip(tables, buffers, strict=True):
        dense = flat[offset : offset + buffer.numel()].view_as(buffer)
        offset += buffer.numel()
        rows = torch.nonzero(dense[:, -1]).flatten()
        ctx.optimizer.update_rows(ctx.name(t), ctx.weight(t), rows, dense[rows, :-1])
