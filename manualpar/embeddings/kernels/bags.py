"""Local compute of a shard: pooled lookup, and per-row gradients for the fused update.

`embedding_bag` runs FBGEMM's CPU kernels inside ATen, and gathers on CUDA. The gradient of
duplicate ids is summed into one row so the optimizer sees each row once, as torch's coalesced
sparse gradient. On CPU the C++ kernels (native.py) do the backward in one pass each; the torch
ops below are the same computation for CUDA and for machines without a compiler.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.nn.functional as F

from manualpar.embeddings.kernels.half_lookup import pooled_sum_half
from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.kernels.rounding import HALF_DTYPES, RowRounding, add_rounded
from manualpar.errors import ConfigError

__all__ = [
    "BagGradients",
    "RowGroups",
    "RowPass",
    "ShardBags",
    "add_to_rows",
    "bag_offsets",
    "group_rows",
    "pooled_sum",
    "row_gradients",
]


@dataclass
class RowGroups:
    """The occurrences of each distinct id (made once per step, while an exchange is in flight),
    ordered by id: each one's original position and bag, where each id's run starts and its
    row, and the runs to visit, the `num_own` touched only by this rank's own bags first."""

    order: torch.Tensor
    starts: torch.Tensor
    bags: torch.Tensor
    rows: torch.Tensor
    runs: torch.Tensor
    num_own: int


@dataclass
class ShardBags:
    """A local shard's bags in one step, every sender's in rank order (the same order on every
    rank, so replicated state sums in the same order everywhere); this rank's own are bags
    [own_begin, own_end)."""

    ids: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None
    own_begin: int
    own_end: int
    groups: RowGroups | None = None


@dataclass
class BagGradients:
    """The gradient of a shard's bags as blocks over consecutive bags (a sender's bags, or one
    feature's column slice of this rank's own output gradient), each with its sender's weight in
    the table gradient. Blocks may be strided views: nothing is copied to line them up."""

    blocks: list[torch.Tensor]
    scales: list[float]

    def dense(self) -> tuple[torch.Tensor, float]:
        """(bags, width) gradient and a common scale, for the per-row (torch) path."""
        if len(set(self.scales)) <= 1:
            scale = self.scales[0] if self.scales else 1.0
            return torch.cat(self.blocks) if len(self.blocks) != 1 else self.blocks[0], scale
        return torch.cat([b * s for b, s in zip(self.blocks, self.scales, strict=True)]), 1.0


class RowPass(IntEnum):
    """Which distinct rows an update pass touches. A row's gradient is complete once all its
    bags have theirs, so rows looked up only by this rank's own bags go first, while the other
    ranks' gradients are still on their way."""

    ALL = 0
    OWN = 1  # rows whose bags are all this rank's own; gradients of those bags only
    REST = 2  # every other row; gradients of all bags

    def span(self, bags: ShardBags) -> tuple[int, int, int, int]:
        """(first run, end run, first bag, end bag) of this pass over `bags`."""
        groups = bags.groups
        assert groups is not None
        runs, num_bags = groups.runs.numel(), bags.lengths.numel()
        if self is RowPass.OWN:
            return 0, groups.num_own, bags.own_begin, bags.own_end
        return (groups.num_own if self is RowPass.REST else 0), runs, 0, num_bags


def group_rows(bags: ShardBags, num_rows: int) -> RowGroups | None:
    """Group a shard's ids by row with the C++ kernel; None where it does not apply."""
    if not (
        native_kernels_take(bags.ids)
        and bags.ids.dtype == torch.int64
        and bags.lengths.dtype == torch.int64
    ):
        return None
    return RowGroups(
        *loaded_kernels().group_rows(
            bags.ids.contiguous(), bags.lengths.contiguous(), num_rows, bags.own_begin, bags.own_end
        )
    )


def bag_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Start offset of each bag (embedding_bag's `offsets`)."""
    offsets = torch.zeros_like(lengths)
    if lengths.numel() > 1:
        torch.cumsum(lengths[:-1], 0, out=offsets[1:])
    return offsets


def pooled_sum(
    weight: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """(bags, cols): the sum of each bag's rows (scaled by per-id weights); float32 for half
    rows (half_lookup.py)."""
    if weight.dtype in HALF_DTYPES:
        return pooled_sum_half(weight, ids, lengths, weights)
    if lengths.numel() == 0:
        return weight.new_zeros(0, weight.shape[1])
    return F.embedding_bag(
        ids, weight, bag_offsets(lengths), mode="sum", per_sample_weights=weights
    )


def row_gradients(
    ids: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    bag_grads: torch.Tensor,
    num_rows: int,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct rows looked up (sorted), and the summed gradient of each times `scale`.

    In torch the sum is itself a pooled lookup: sort the ids, and each distinct id's "bag" holds
    the bags it occurs in, so embedding_bag over the bag gradients sums them with the fast kernel
    (index_add_ on CPU loops per index and is several times slower).
    """
    if native_kernels_take(bag_grads, weights) and (
        weights is None or weights.dtype == bag_grads.dtype
    ):
        rows, summed = loaded_kernels().segment_sum(
            ids, lengths, weights, bag_grads.contiguous(), num_rows, scale
        )
        return rows, summed
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
    sorted_ids, order = torch.sort(ids, stable=True)  # each row sums its bags in order
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    if rows.numel() == 0:
        return rows, bag_grads.new_zeros(0, bag_grads.shape[1])
    summed = F.embedding_bag(
        bag[order],
        bag_grads,
        bag_offsets(counts),
        mode="sum",
        per_sample_weights=None if weights is None else weights[order],
    )
    return rows, summed.mul_(scale) if scale != 1.0 else summed


def add_to_rows(
    tensor: torch.Tensor,
    rows: torch.Tensor,
    delta: torch.Tensor,
    alpha: float = 1.0,
    rounding: RowRounding | None = None,
) -> None:
    """tensor[rows] += alpha * delta for distinct rows (gather, add, scatter: no index_add_);
    half rows add in float32 and round by `rounding` (rounding.py)."""
    if tensor.dtype in HALF_DTYPES:
        if rounding is None:
            raise ConfigError(
                f"add_to_rows: updating {tensor.dtype} rows needs a RowRounding (half rows "
                "round their float32 sums); pass rounding="
            )
        add_rounded(tensor, rows, delta, alpha, rounding)
        return
    if (
        native_kernels_take(tensor, delta)
        and delta.dtype == tensor.dtype
        and tensor.is_contiguous()
        and rows.dtype == torch.int64
    ):
        loaded_kernels().add_to_rows(tensor, rows.contiguous(), delta.contiguous(), alpha)
        return
    tensor.index_copy_(0, rows, tensor.index_select(0, rows).add_(delta, alpha=alpha))
