"""A sender's bags on the step's way: a row-split table's ids grouped by row range (sender
side), one shard's bags from every sender combined (owner side), and the pooled rows packed
for their senders (exchange.py lays the buffers out)."""

from __future__ import annotations

import torch

from manualpar.embeddings.kernels.bags import ShardBags
from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.step.routing import Routing

__all__ = ["SenderBags", "combine_senders", "pack_pooled", "split_by_rows"]

SenderBags = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # ids, lengths, weights


def split_by_rows(
    ids: torch.Tensor,
    lengths: torch.Tensor,
    routing: Routing,
    table: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row-split table's ids grouped by the row range holding them, bag order kept inside
    each group: (groups, bags) counts, the ids made local to their range, and the order taken
    (to reorder per-id weights)."""
    starts = routing.row_start_tensors[table]
    if native_kernels_take(ids) and ids.dtype == torch.int64 and lengths.dtype == torch.int64:
        counts, local, order = loaded_kernels().split_by_rows(
            ids.contiguous(), lengths.contiguous(), starts
        )
        return counts, local, order
    batch = lengths.numel()
    starts = starts.to(ids.device)
    group = torch.bucketize(ids, starts[1:], right=True)
    bag = torch.repeat_interleave(torch.arange(batch, device=ids.device), lengths)
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group * batch + bag, minlength=len(starts) * batch)
    return counts.view(len(starts), batch), ids[order] - starts[group[order]], order


def combine_senders(parts: list[SenderBags], rank: int) -> ShardBags:
    """One shard's bags from every sender, in rank order, as one input; senders without
    weights get weight 1 if another sender has them."""
    weighted = any(w is not None for _, _, w in parts)
    own_begin = sum(lens.numel() for _, lens, _ in parts[:rank])
    own_end = own_begin + parts[rank][1].numel()
    if len(parts) == 1:
        return ShardBags(*parts[0], own_begin, own_end)
    weights = None
    if weighted:
        weights = torch.cat(
            [w if w is not None else torch.ones(i.numel(), device=i.device) for i, _, w in parts]
        )
    return ShardBags(
        torch.cat([ids for ids, _, _ in parts]),
        torch.cat([lens for _, lens, _ in parts]),
        weights,
        own_begin,
        own_end,
    )


def pack_pooled(
    pooled: list[list[torch.Tensor] | None],
    like: torch.Tensor,
) -> tuple[torch.Tensor, list[int]]:
    """Owner side: per sender rank, the pooled rows of its bags for each local shard (None for
    ourselves) -> one buffer by destination (dtype and device of `like`), and the send splits
    (0 to ourselves)."""
    flat = [
        torch.cat([rows.flatten() for rows in shards]) if shards else like.new_empty(0)
        for shards in pooled
    ]
    return torch.cat(flat), [p.numel() for p in flat]
