"""Row-wise Adagrad's fused pass (step_bags, the hot path) on half-precision rows.

The same pass as for float32 rows (update_rules.RowWiseAdagrad.step_bags): each distinct row's
gradient summed from its bags' gradients, the row's float32 state updated, and the row written
once, here in float32 and rounded back by `rounding` (rounding.py). Only the C++ kernel has it;
without the kernel the caller sums row gradients and takes `step_rows`, whose rounding draws the
same bits (the float32 values before rounding may differ in the last bit between the two
formulas, as they do for float32 rows).
"""

from __future__ import annotations

import torch

from manualpar.embeddings.native import loaded_kernels, supports
from manualpar.embeddings.rounding import RowRounding
from manualpar.embeddings.shard_compute import BagGradients, RowPass, ShardBags

__all__ = ["rowwise_adagrad_rounded"]


def rowwise_adagrad_rounded(
    weight: torch.Tensor,
    state: torch.Tensor,
    bags: ShardBags,
    grads: BagGradients,
    col_start: int,
    rows: RowPass,
    lr: float,
    eps: float,
    rounding: RowRounding,
) -> bool:
    """Run the fused pass if the kernel takes these tensors; False: not done (take step_rows)."""
    if not (
        bags.groups is not None
        and supports(weight, state, bags.weights, *grads.blocks)
        and weight.is_contiguous()
        and state.dtype == torch.float32
        and all(b.dtype == torch.float32 and b.stride(-1) == 1 for b in grads.blocks)
        and (bags.weights is None or bags.weights.dtype == torch.float32)
    ):
        return False
    groups = bags.groups
    run_begin, run_end, first_bag, end_bag = rows.span(bags)
    loaded_kernels().rowwise_adagrad_update_rounded(
        weight,
        state,
        bags.weights,
        groups.order,
        groups.starts,
        groups.bags,
        groups.rows,
        groups.runs,
        run_begin,
        run_end,
        grads.blocks,
        grads.scales,
        first_bag,
        end_bag,
        col_start,
        lr,
        eps,
        rounding.draws,
        rounding.key,
        rounding.row_start,
        rounding.dim,
        rounding.slot_rows,
    )
    return True
