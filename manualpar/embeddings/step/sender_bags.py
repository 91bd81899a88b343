"""A sender's bags on the step's way: whole features packed for their owners as slices of the
batch, a row-split table's ids grouped by row range (sender side), one shard's bags from every
sender combined (owner side), and the pooled rows packed for their senders (exchange.py lays
the buffers out)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.kernels.bags import ShardBags
from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.step.routing import Routing

__all__ = [
    "Packed",
    "SenderBags",
    "combine_senders",
    "feature_runs",
    "join_payloads",
    "pack_pooled",
    "pack_runs",
    "split_by_rows",
    "weight_bits",
]

SenderBags = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # ids, lengths, weights
Runs = list[list[tuple[int, int]]]  # per destination rank: [first, end) feature runs


def weight_bits(weights: torch.Tensor) -> torch.Tensor:
    """Per-id weights as the int64 values that travel with the ids (their float32 bits)."""
    return weights.to(torch.float32).view(torch.int32).to(torch.int64)


def feature_runs(dests_of: list[tuple[int, list[int] | None]], world: int) -> Runs | None:
    """Per destination rank, the runs [first, end) of consecutive features sent to it whole, in
    the order they are packed (`dests_of`: each routed feature and its owners, in feature
    order); None where a feature's ids are split by rows (cut per owner: packed one by one)."""
    runs: Runs = [[] for _ in range(world)]
    for f, dests in dests_of:
        if dests is None:
            return None
        for dest in dests:
            if runs[dest] and runs[dest][-1][1] == f:
                runs[dest][-1] = (runs[dest][-1][0], f + 1)
            else:
                runs[dest].append((f, f + 1))
    return runs


class Packed(NamedTuple):
    """A step's ids payloads, every one in a single buffer, joined once."""

    payloads: list[torch.Tensor]  # per destination rank (ours too): views of the buffer
    send: torch.Tensor  # the other ranks' payloads in rank order, one slice: what travels


def join_payloads(
    pieces_to: list[list[torch.Tensor]],
    rank: int,
    device: torch.device,
    sizes_to: list[int] | None = None,
) -> Packed:
    """Per destination rank, its payload's pieces -> every payload in one buffer, by one join:
    the other ranks' in rank order (sent as one slice, not joined again), then ours
    (`sizes_to`: each payload's length, if known)."""
    order = [*(d for d in range(len(pieces_to)) if d != rank), rank]
    pieces = [piece for d in order for piece in pieces_to[d]]
    if not pieces:
        buffer = torch.empty(0, dtype=torch.int64, device=device)
    else:  # each piece int64 already: the join is the one copy
        buffer = torch.cat(pieces).to(torch.int64)
    if sizes_to is None:
        sizes_to = [sum(piece.numel() for piece in pieces) for pieces in pieces_to]
    sizes = [sizes_to[d] for d in order]
    payloads = [buffer] * len(pieces_to)
    for d, view in zip(order, buffer.split(sizes), strict=True):
        payloads[d] = view
    return Packed(payloads, buffer[: buffer.numel() - sizes[-1]])


def pack_runs(
    runs: Runs,
    features: SparseFeatures,
    bag_counts: Sequence[int],
    heads: list[list[torch.Tensor]],
    rank: int,
) -> Packed:
    """Per destination rank: its `heads`, then the bag lengths, ids and weight bits of its
    feature runs, each a slice of the batch (`bag_counts`: each feature's bags), so a run of
    features costs one piece, not one per feature; all of them joined once (join_payloads)."""
    lengths, values, weights = features.lengths, features.values, features.weights
    bag_at = [0, *itertools.accumulate(bag_counts)]
    id_at = [0, *itertools.accumulate(features.feature_sizes())]
    bits = None if weights is None else weight_bits(weights)
    pieces_to: list[list[torch.Tensor]] = []
    sizes_to = []  # found from the offsets: no call per piece
    for d, dest_runs in enumerate(runs):
        if not dest_runs:
            pieces_to.append([])
            sizes_to.append(0)
            continue
        pieces_to.append(
            [
                *heads[d],
                *(lengths[bag_at[a] : bag_at[b]] for a, b in dest_runs),
                *(values[id_at[a] : id_at[b]] for a, b in dest_runs),
                *(() if bits is None else (bits[id_at[a] : id_at[b]] for a, b in dest_runs)),
            ]
        )
        ids = sum(id_at[b] - id_at[a] for a, b in dest_runs)
        lens = sum(bag_at[b] - bag_at[a] for a, b in dest_runs)
        head = sum(h.numel() for h in heads[d])
        sizes_to.append(head + lens + ids * (1 if bits is None else 2))
    return join_payloads(pieces_to, rank, values.device, sizes_to)


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
    (0 to ourselves). Every block is copied once, by one join (embedding_bag has no output
    argument: its `.out` overload computes and then copies, measured slower than this)."""
    splits = [sum(rows.numel() for rows in shards) if shards else 0 for shards in pooled]
    blocks = [rows.flatten() for shards in pooled if shards for rows in shards]
    if not blocks:
        return like.new_empty(0), splits
    return torch.cat(blocks).to(like.dtype), splits
