"""Local compute of a shard: pooled lookup, and per-row gradients for the fused update.

`embedding_bag` runs FBGEMM's CPU kernels inside ATen, and gathers on CUDA. The gradient of
duplicate ids is summed into one row so the optimizer sees each row once, as torch's coalesced
sparse gradient. On CPU the C++ kernels (native.py) do the backward in one pass each; the torch
ops below are the same computation for CUDA and for machines without a compiler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from manualpar.embeddings.native import native_kernels, supports

__all__ = ["add_to_rows", "bag_offsets", "pooled_sum", "row_gradients"]


def bag_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Start offset of each bag (embedding_bag's `offsets`)."""
    offsets = torch.zeros_like(lengths)
    if lengths.numel() > 1:
        torch.cumsum(lengths[:-1], 0, out=offsets[1:])
    return offsets


def pooled_sum(weight: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor,
               weights: torch.Tensor | None) -> torch.Tensor:
    """(bags, cols): the sum of each bag's rows (scaled by per-id weights)."""
    if lengths.numel() == 0:
        return weight.new_zeros(0, weight.shape[1])
    return F.embedding_bag(ids, weight, bag_offsets(lengths), mode="sum",
                           per_sample_weights=weights)


def row_gradients(ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None,
                  bag_grads: torch.Tensor, num_rows: int,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct rows looked up (sorted), and the summed gradient of each times `scale`.

    In torch the sum is itself a pooled lookup: sort the ids, and each distinct id's "bag" holds
    the bags it occurs in, so embedding_bag over the bag gradients sums them with the fast kernel
    (index_add_ on CPU loops per index and is several times slower).
    """
    if supports(bag_grads, weights) and (weights is None or weights.dtype == bag_grads.dtype):
        rows, summed = native_kernels().segment_sum(ids, lengths, weights,
                                                    bag_grads.contiguous(), num_rows, scale)
        return rows, summed
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
    sorted_ids, order = torch.sort(ids)
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    if rows.numel() == 0:
        return rows, bag_grads.new_zeros(0, bag_grads.shape[1])
    summed = F.embedding_bag(bag[order], bag_grads, bag_offsets(counts), mode="sum",
                             per_sample_weights=None if weights is None else weights[order])
    return rows, summed.mul_(scale) if scale != 1.0 else summed


def add_to_rows(tensor: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor,
                alpha: float = 1.0) -> None:
    """tensor[rows] += alpha * delta for distinct rows (gather, add, scatter: no index_add_)."""
    if (supports(tensor, delta) and delta.dtype == tensor.dtype and tensor.is_contiguous()
            and rows.dtype == torch.int64):
        native_kernels().add_to_rows(tensor, rows.contiguous(), delta.contiguous(), alpha)
        return
    tensor.index_copy_(0, rows, tensor.index_select(0, rows).add_(delta, alpha=alpha))
