"""Local compute of a shard: pooled lookup, and per-row gradients for the fused update.

Pure torch: `embedding_bag` runs FBGEMM's CPU kernels inside ATen and cuBLAS-free gathers on
CUDA; the gradient of duplicate ids is summed into one row (sorted unique + index_add) so the
optimizer sees each row once, as torch's coalesced sparse gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["bag_offsets", "pooled_sum", "row_gradients"]


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
                  bag_grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct rows looked up, and the summed gradient of each (rows, width)."""
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
    per_id = bag_grads.index_select(0, bag)
    if weights is not None:
        per_id.mul_(weights.unsqueeze(1))
    rows, inverse = torch.unique(ids, return_inverse=True)
    summed = bag_grads.new_zeros(rows.numel(), bag_grads.shape[1]).index_add_(0, inverse, per_id)
    return rows, summed
