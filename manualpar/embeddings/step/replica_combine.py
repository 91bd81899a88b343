"""Summing table gradients across the replicas of a 2-D sharded collection, sparsely.

Each replica group (a row of the mesh) has, for each of its blocks, the summed gradients of the
distinct rows its own batches touched. The same block on the other replicas got gradients from
other batches. Every replica sends its (rows, gradients) to the others over the replicate dim
(one all_to_all of the counts, one of the rows and values) and each adds the parts up, in
replica order, into the union of the rows: every replica then applies the same update to the
same rows, bit for bit, and the result is the gradient of the whole job's loss.

Sent per rank per step: (replicas - 1) x sum over blocks of touched rows x (width + 2) floats
(row ids travel as int64 bit patterns, two floats each), plus (replicas - 1) x blocks counts.
A dense all-reduce would send the whole block instead; touched rows are far fewer for large
tables, which are the ones worth sharding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from manualpar.embeddings.config import BUILDER

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["RowGradients", "combine_bytes", "combine_replicas"]

RowGradients = tuple[torch.Tensor, torch.Tensor]  # distinct rows (int64), their summed gradient


def _pack(parts: list[RowGradients]) -> torch.Tensor:
    """Rows (as float32 pairs) and gradients of every block, one flat float32 buffer."""
    pieces = []
    for rows, summed in parts:
        pieces.append(rows.to(torch.int64).contiguous().view(torch.float32))
        pieces.append(summed.to(torch.float32).flatten())
    return torch.cat(pieces) if pieces else torch.empty(0)


def _unpack(flat: torch.Tensor, counts: list[int], widths: list[int]) -> list[RowGradients]:
    parts, offset = [], 0
    for count, width in zip(counts, widths, strict=True):
        rows = flat[offset : offset + 2 * count].clone().view(torch.int64)
        offset += 2 * count
        values = flat[offset : offset + count * width].view(count, width)
        offset += count * width
        parts.append((rows, values))
    return parts


def combine_bytes(counts: list[int], widths: list[int], replicas: int) -> int:
    """Bytes one rank sends for a step's combine: its rows, gradients and counts."""
    payload = sum(c * (w + 2) for c, w in zip(counts, widths, strict=True)) * 4
    return (replicas - 1) * (payload + 8 * len(counts))


def combine_replicas(
    strategy: ManualParallelStrategy, replicate: DeviceMesh, parts: list[RowGradients]
) -> list[RowGradients]:
    """Per block: the union of every replica's rows and their summed gradients (the same on
    every replica). `parts` has one entry per block, in the same block order on every replica;
    their widths agree (the same plan and update rule)."""
    if not parts:  # the same on every replica: they hold the same blocks
        return []
    replicas, me = strategy.group_size(replicate), strategy.group_rank(replicate)
    device = parts[0][1].device
    widths = [summed.shape[1] for _, summed in parts]
    mine = torch.tensor([rows.numel() for rows, _ in parts], dtype=torch.int64, device=device)
    blocks = len(parts)
    counts_in = strategy.all_to_all(
        mine.repeat(replicas),
        [blocks] * replicas,
        [blocks] * replicas,
        name=f"{BUILDER}: replica row-count all_to_all",
        group=replicate,
    )
    counts = counts_in.view(replicas, blocks).tolist()
    sizes = [sum(c * (w + 2) for c, w in zip(row, widths, strict=True)) for row in counts]
    payload = _pack(parts).to(device)
    received = strategy.all_to_all(
        payload.repeat(replicas - 1),
        [0 if r == me else payload.numel() for r in range(replicas)],
        [0 if r == me else sizes[r] for r in range(replicas)],
        name=f"{BUILDER}: replica gradient all_to_all",
        group=replicate,
    )
    by_replica: list[list[RowGradients]] = []
    offset = 0
    for r in range(replicas):
        if r == me:
            by_replica.append(parts)
            continue
        by_replica.append(_unpack(received[offset : offset + sizes[r]], counts[r], widths))
        offset += sizes[r]
    return [_add_up([mine_[k] for mine_ in by_replica]) for k in range(blocks)]


def _add_up(parts: list[RowGradients]) -> RowGradients:
    """Sum (rows, gradients) parts with distinct rows each, in the given order (so every
    replica rounds alike; the rows of one part never collide, so no atomics are involved)."""
    union = torch.unique(torch.cat([rows for rows, _ in parts]))
    total = parts[0][1].new_zeros(union.numel(), parts[0][1].shape[1])
    for rows, values in parts:
        if rows.numel():
            total[torch.searchsorted(union, rows)] += values.to(total.dtype)
    return union, total
