"""Row-wise Adagrad's fused pass (step_bags, the hot path), float32 and half-precision rows.

Each distinct row's gradient is summed from its bags' gradients, the row's state updated and the
row written once, by one C++ kernel per dtype family: float32/float64 rows compute in their own
dtype; half rows (float16, bfloat16) compute in float32 and round back by `rounding`
(rounding.py). Without the kernel the caller sums row gradients and takes `step_rows`, whose
rounding draws the same bits (the float32 values before rounding may differ in the last bit
between the two formulas, as they do for float32 rows).
"""

from __future__ import annotations

import torch

from manualpar.embeddings.kernels.bags import BagGradients, RowPass, ShardBags
from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.kernels.rounding import HALF_DTYPES, RowRounding
from manualpar.embeddings.kernels.table_batch import TableBatch

__all__ = ["rowwise_adagrad_fused", "rowwise_adagrad_tables"]


def rowwise_adagrad_fused(
    weight: torch.Tensor,
    state: torch.Tensor,
    bags: ShardBags,
    grads: BagGradients,
    col_start: int,
    rows: RowPass,
    lr: float,
    eps: float,
    rounding: RowRounding | None,
) -> bool:
    """Run the fused pass if the kernel takes these tensors (half rows need `rounding`);
    False: not done (take step_rows)."""
    half = weight.dtype in HALF_DTYPES
    compute = torch.float32 if half else weight.dtype  # gradients, state and per-id weights
    if not (
        bags.groups is not None
        and (rounding is not None or not half)
        and native_kernels_take(weight, state, bags.weights, *grads.blocks)
        and weight.is_contiguous()
        and state.dtype == compute
        and all(b.dtype == compute and b.stride(-1) == 1 for b in grads.blocks)
        and (bags.weights is None or bags.weights.dtype == compute)
    ):
        return False
    groups = bags.groups
    run_begin, run_end, first_bag, end_bag = rows.span(bags)
    common = (
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
    )
    kernels = loaded_kernels()
    if rounding is None or not half:
        kernels.rowwise_adagrad_update(*common)
    else:
        kernels.rowwise_adagrad_update_rounded(
            *common,
            rounding.draws,
            rounding.key,
            rounding.row_start,
            rounding.dim,
            rounding.slot_rows,
        )
    return True


def rowwise_adagrad_tables(
    weights: list[torch.Tensor],
    states: list[torch.Tensor],
    batch: TableBatch,
    grads: BagGradients,
    widths: list[int],
    col_starts: list[int],
    rows: RowPass,
    lr: float,
    eps: float,
) -> None:
    """The fused pass over every table of a batch in one call (table_batch.py; float rows,
    grouped by `group_batch`): row by row the arithmetic of `rowwise_adagrad_fused`."""
    bags = batch.bags
    groups = bags.groups
    assert groups is not None
    run_begin, run_end, first_bag, end_bag = rows.span(bags)
    loaded_kernels().rowwise_adagrad_update_tables(
        weights,
        states,
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
        batch.row_offsets,
        widths,
        col_starts,
        lr,
        eps,
    )
