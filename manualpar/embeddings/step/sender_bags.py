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
    "EverySplit",
    "Packed",
    "SenderBags",
    "combine_senders",
    "every_split",
    "feature_runs",
    "join_payloads",
    "pack_pooled",
    "pack_runs",
    "pack_split_rows",
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


class EverySplit(NamedTuple):
    """A plan whose every feature's table is split by rows into the same groups, each group's
    rows held by the same rank for every feature (row-wise plans): `pack_split_rows`' input."""

    row_starts: torch.Tensor  # (features, groups): each feature's table's row range starts
    group_order: torch.Tensor  # the groups in payload order (the other ranks', then ours)
    dests: list[int]  # each group's owner, in payload order


# the most row groups `pack_split_rows` takes: it tests each id against every range start (no
# branch to mispredict), where the per-feature split searches them (more groups: per feature)
SPLIT_PACK_GROUPS = 16


def every_split(
    routing: Routing, feature_dests: list[tuple[int, int, list[int] | None]]
) -> EverySplit | None:
    """`feature_dests` (each routed feature, its table, and its owners if sent whole) as an
    `EverySplit` where every feature of the batch is split by rows into the same row groups,
    group g held by the same rank for every feature (row-wise plans); else None."""
    if len(feature_dests) != len(routing.features):
        return None  # replicated features: not packed at all
    owners: list[int] | None = None
    starts = []
    for f, table, dests in feature_dests:
        groups = sorted((route.row_group, dest) for dest, route in routing.routes_of_feature[f])
        if dests is not None or [g for g, _ in groups] != list(range(len(groups))):
            return None  # sent whole, or a row group split by columns too
        feature_owners = [dest for _, dest in groups]
        owners = feature_owners if owners is None else owners
        if feature_owners != owners or len(set(owners)) != len(owners):
            return None
        starts.append(routing.row_start_tensors[table])
    if owners is None or len(owners) > SPLIT_PACK_GROUPS:
        return None
    rank = routing.rank
    payload_order = [*(d for d in range(routing.world_size) if d != rank), rank]
    order = [owners.index(d) for d in payload_order if d in owners]
    row_starts = torch.stack(starts)
    return EverySplit(
        row_starts, torch.tensor(order, dtype=torch.int64), [owners[g] for g in order]
    )


def pack_split_rows(split: EverySplit, features: SparseFeatures, rank: int, world: int) -> Packed:
    """A plain batch's ids payloads under `split`, packed by one kernel pass over the ids: the
    same buffer `split_by_rows` per feature and `join_payloads` give (each owner's bag lengths,
    features in order, then its ids made local), without a tensor per feature. The caller
    checks that the kernels take the batch (int64 on CPU, no per-id weights, one batch)."""
    buffer, sizes = loaded_kernels().pack_split_rows(
        features.values.contiguous(), features.lengths.contiguous(), *split[:2]
    )
    views = buffer.split(sizes.tolist())
    payloads = [buffer[:0]] * world  # a rank holding no group gets nothing
    for dest, view in zip(split.dests, views, strict=True):
        payloads[dest] = view
    return Packed(payloads, buffer[: buffer.numel() - payloads[rank].numel()])


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
