"""One step's communication: ids to the shards' owners, pooled rows back, gradients to owners.

Per step, in order (each one `all_to_all_single`; the list form fails on gloo for unequal sizes):
  1. sizes: every rank sends every rank [batch size, payload length, weighted];
  2. payload: bag lengths, ids (row-local) and per-id weights (as int64 bit patterns) in one
     buffer per destination, so one collective carries all three;
  3. pooled output: each owner sends back per-bag partial sums (row-wise shards are summed, and
     column blocks concatenated, by the receiver: no separate reduce-scatter);
  4. in backward, the reverse of 3 carries the output gradient.
Row-wise tables split each feature's ids by row range (a stable sort keeps bag order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from manualpar.embeddings.native import native_kernels, supports
from manualpar.embeddings.routing import LocalShard, Routing
from manualpar.errors import EmbeddingInputError

__all__ = [
    "REFUSED",
    "ReceivedIds",
    "SentIds",
    "assemble_output",
    "exchange_ids",
    "grad_receive_splits",
    "pack_output_grad",
    "split_by_rows",
    "split_output",
    "unpack_output_grad",
]

AllToAll = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]
REFUSED = -1  # the sizes a rank sends when its own batch failed validation


@dataclass
class SentIds:
    """What this rank sent (kept to assemble its output and route its gradient)."""

    batch_size: int
    lengths: torch.Tensor           # (features, batch) bag lengths of this rank's batch
    batch_sizes: list[int]          # every rank's batch size (from the size exchange)


@dataclass
class ShardInput:
    """All senders' bags for one local shard, bag order (sender, feature, sample)."""

    ids: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None


@dataclass
class ReceivedIds:
    shards: list[ShardInput]        # one per routed local shard, in Routing order
    batch_sizes: list[int]          # per sender


def _weight_bits(weights: torch.Tensor) -> torch.Tensor:
    return weights.to(torch.float32).view(torch.int32).to(torch.int64)


def _bits_weight(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def exchange_ids(routing: Routing, values: torch.Tensor, lengths: torch.Tensor,
                 weights: torch.Tensor | None, all_to_all: AllToAll,
                 ) -> tuple[SentIds, ReceivedIds]:
    """Send each routed feature's bags to the owners of its table's shards; receive ours."""
    world = routing.world_size
    num_features = len(routing.features)
    batch = lengths.numel() // num_features if num_features else 0
    lengths = lengths.view(num_features, batch)
    per_feature = lengths.sum(1).tolist()
    starts = [0]
    for count in per_feature:
        starts.append(starts[-1] + count)
    lens_to: list[list[torch.Tensor]] = [[] for _ in range(world)]
    ids_to: list[list[torch.Tensor]] = [[] for _ in range(world)]
    weights_to: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for f, routes in enumerate(routing.routes_of_feature):
        if not routes:
            continue
        table = routes[0][1].table
        ids = values[starts[f]:starts[f + 1]]
        w = None if weights is None else weights[starts[f]:starts[f + 1]]
        if not routing.splits_rows(table):
            for dest, _ in routes:
                lens_to[dest].append(lengths[f])
                ids_to[dest].append(ids)
                if w is not None:
                    weights_to[dest].append(w)
            continue
        counts, local_ids, order = split_by_rows(ids, lengths[f], routing, table)
        sizes = counts.sum(1).tolist()
        id_parts = local_ids.split(sizes)
        w_parts = None if w is None else w[order].split(sizes)
        for dest, route in routes:
            g = route.row_group
            lens_to[dest].append(counts[g])
            ids_to[dest].append(id_parts[g])
            if w_parts is not None:
                weights_to[dest].append(w_parts[g])
    weighted = weights is not None
    payloads = [torch.cat([*lens_to[d], *ids_to[d],
                           *(_weight_bits(w) for w in weights_to[d])]).to(torch.int64)
                if lens_to[d] else torch.empty(0, dtype=torch.int64, device=values.device)
                for d in range(world)]
    sizes_out = torch.tensor([[batch, p.numel(), int(weighted)] for p in payloads],
                             dtype=torch.int64, device=values.device).flatten()
    sizes_in = all_to_all(sizes_out, [3] * world, [3] * world).view(world, 3).tolist()
    refused = [rank for rank, size in enumerate(sizes_in) if size[0] == REFUSED]
    if refused:
        raise EmbeddingInputError(
            f"rank {', '.join(map(str, refused))} refused its batch (the error is in that "
            f"rank's log); every rank stops at this step. Fix the input on that rank")
    received = all_to_all(torch.cat(payloads), [p.numel() for p in payloads],
                          [size[1] for size in sizes_in])
    batch_sizes = [size[0] for size in sizes_in]
    shards = _unpack_ids(routing, received, sizes_in)
    return SentIds(batch, lengths, batch_sizes), ReceivedIds(shards, batch_sizes)


def split_by_rows(ids: torch.Tensor, lengths: torch.Tensor, routing: Routing, table: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row-split table's ids grouped by the row range holding them, bag order kept inside
    each group: (groups, bags) counts, the ids made local to their range, and the order taken
    (to reorder per-id weights)."""
    starts = routing.row_start_tensors[table]
    if supports(ids) and ids.dtype == torch.int64 and lengths.dtype == torch.int64:
        counts, local, order = native_kernels().split_by_rows(ids.contiguous(),
                                                              lengths.contiguous(), starts)
        return counts, local, order
    batch = lengths.numel()
    starts = starts.to(ids.device)
    group = torch.bucketize(ids, starts[1:], right=True)
    bag = torch.repeat_interleave(torch.arange(batch, device=ids.device), lengths)
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group * batch + bag, minlength=len(starts) * batch)
    return counts.view(len(starts), batch), ids[order] - starts[group[order]], order


def _unpack_ids(routing: Routing, received: torch.Tensor, sizes_in: list[list[int]],
                ) -> list[ShardInput]:
    local = routing.routed_local_shards()
    my_routes = len(routing.routes_to[routing.rank])
    any_weighted = any(size[2] for size in sizes_in)
    parts: list[list[list[torch.Tensor]]] = [[[], [], []] for _ in local]  # lens, ids, weights
    offset = 0
    for batch, length, weighted in sizes_in:
        chunk = received[offset:offset + length]
        offset += length
        if not my_routes:
            continue
        lens = chunk[:my_routes * batch].view(my_routes, batch)
        route_ids = lens.sum(1).tolist()
        total = sum(route_ids)
        ids = chunk[my_routes * batch:my_routes * batch + total]
        bits = chunk[my_routes * batch + total:] if weighted else None
        row = id_start = 0
        for k, shard in enumerate(local):
            count = len(shard.features)
            n_ids = sum(route_ids[row:row + count])
            parts[k][0].append(lens[row:row + count].flatten())
            parts[k][1].append(ids[id_start:id_start + n_ids])
            if any_weighted:
                parts[k][2].append(_bits_weight(bits[id_start:id_start + n_ids]) if weighted
                                   else torch.ones(n_ids, device=received.device))
            row += count
            id_start += n_ids
    empty = received.new_empty(0)
    return [ShardInput(torch.cat(ids) if ids else empty, torch.cat(lens) if lens else empty,
                       torch.cat(ws) if any_weighted and ws else None)
            for lens, ids, ws in parts]


def split_output(routing: Routing, pooled: list[torch.Tensor], batch_sizes: list[int],
                 ) -> tuple[torch.Tensor, list[int]]:
    """Owner side: per-shard pooled partials (bags in (sender, feature, sample) order) -> one
    buffer ordered by destination sender, and its split sizes."""
    local = routing.routed_local_shards()
    pieces: list[list[torch.Tensor]] = [[] for _ in batch_sizes]
    for shard, rows in zip(local, pooled, strict=True):
        per_sender = rows.split([len(shard.features) * b for b in batch_sizes])
        for sender, block in enumerate(per_sender):
            pieces[sender].append(block.flatten())
    empty = pooled[0].new_empty(0) if pooled else torch.empty(0)
    flat = [torch.cat(p) if p else empty for p in pieces]
    return torch.cat(flat), [p.numel() for p in flat]


def output_splits(routing: Routing, batch: int) -> list[int]:
    """Receiver side: how many floats each owner sends back for a batch of `batch` samples."""
    return [batch * sum(r.cols for r in routes) for routes in routing.routes_to]


def assemble_output(routing: Routing, received: torch.Tensor, batch: int) -> torch.Tensor:
    """Receiver side: owners' partial blocks -> (batch, total_dim), summing row shards."""
    out = received.new_zeros(batch, routing.total_dim)
    offset = 0
    for routes in routing.routes_to:
        for route in routes:
            size = batch * route.cols
            block = received[offset:offset + size].view(batch, route.cols)
            offset += size
            start = routing.feature_offsets[route.feature] + route.shard.col_start
            out[:, start:start + route.cols] += block
    return out


def grad_width(routing: Routing, shard: LocalShard, full_rows: bool) -> int:
    """Columns of the output gradient an owner receives for one of its shards."""
    if full_rows and routing.splits_cols(shard.table):
        return routing.tables[shard.table].embedding_dim
    return shard.shard.cols


def pack_output_grad(routing: Routing, grad: torch.Tensor, full_rows: bool,
                     ) -> tuple[torch.Tensor, list[int]]:
    """Sender side: the output gradient blocks each owner needs, in its route order."""
    blocks: list[torch.Tensor] = []
    splits = []
    for routes in routing.routes_to:
        start_len = len(blocks)
        for route in routes:
            base = routing.feature_offsets[route.feature]
            if full_rows and routing.splits_cols(route.table):
                blocks.append(grad[:, base:base + routing.dims[route.feature]].flatten())
            else:
                start = base + route.shard.col_start
                blocks.append(grad[:, start:start + route.cols].flatten())
        splits.append(sum(b.numel() for b in blocks[start_len:]))
    flat = torch.cat(blocks) if blocks else torch.empty(0, dtype=grad.dtype)
    return flat, splits


def grad_receive_splits(routing: Routing, batch_sizes: list[int], full_rows: bool) -> list[int]:
    """Owner side: how many gradient floats each sender sends for our shards."""
    local = routing.routed_local_shards()
    per_sample = sum(len(s.features) * grad_width(routing, s, full_rows) for s in local)
    return [b * per_sample for b in batch_sizes]


def unpack_output_grad(routing: Routing, received: torch.Tensor, batch_sizes: list[int],
                       full_rows: bool) -> list[torch.Tensor]:
    """Owner side: per local shard, gradient rows aligned with its pooled bags."""
    local = routing.routed_local_shards()
    widths = [grad_width(routing, s, full_rows) for s in local]
    per_shard: list[list[torch.Tensor]] = [[] for _ in local]
    offset = 0
    for batch in batch_sizes:
        for k, (shard, width) in enumerate(zip(local, widths, strict=True)):
            rows = len(shard.features) * batch
            per_shard[k].append(received[offset:offset + rows * width].view(rows, width))
            offset += rows * width
    return [torch.cat(p) if p else received.new_empty(0, w)
            for p, w in zip(per_shard, widths, strict=True)]
