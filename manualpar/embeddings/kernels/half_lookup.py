"""Pooled lookups of half-precision rows (float16, bfloat16), summed in float32.

A bag of many rows summed in float16 or bfloat16 would lose the small ones (and float16 can
overflow), so each row is widened to float32 before it is added and the pooled output is float32
whatever the rows' dtype; the sharded exchange of pooled rows carries float32 too. On CPU the
C++ kernel sums straight from the half rows; the torch ops below (CUDA, no compiler) gather the
rows, widen, scale each by its per-id weight and sum each bag in id order, the kernel's exact
order and roundings, so both give the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take

__all__ = ["pooled_sum_half"]


def pooled_sum_half(
    weight: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    *,
    sparse_grad: bool = False,
) -> torch.Tensor:
    """(bags, cols) float32 sums of each bag's half rows (scaled by float32 per-id weights).

    `sparse_grad`: differentiable, the rows' gradient a sparse tensor (the unsharded
    collection's); else under no_grad (the sharded lookup)."""
    if weights is not None:
        weights = weights.to(torch.float32)
    if (
        not sparse_grad
        and native_kernels_take(weight, ids, lengths)
        and weight.is_contiguous()
        and ids.dtype == lengths.dtype == torch.int64
    ):
        return loaded_kernels().pooled_sum_half(
            weight, ids.contiguous(), lengths.contiguous(), weights
        )
    rows = F.embedding(ids, weight, sparse=sparse_grad).float()
    if weights is not None:
        rows = rows * weights.unsqueeze(1)
    if lengths.numel() == 0:
        return rows.new_zeros(0, weight.shape[1])
    offsets = torch.zeros_like(lengths)
    if lengths.numel() > 1:
        torch.cumsum(lengths[:-1], 0, out=offsets[1:])
    positions = torch.arange(ids.numel(), device=ids.device)
    return F.embedding_bag(positions, rows, offsets, mode="sum")
