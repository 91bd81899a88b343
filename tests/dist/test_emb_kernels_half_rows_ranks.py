"""Half-precision tables (float16, bfloat16) on real gloo ranks against a float64 reference.

Each optimizer x dtype x plan (table-wise, row-wise, column-wise, data-parallel) trains 3 steps
in one launch on 2 ranks, and the mixed plan with uneven row and column splits on 3 ranks (one
rank with an empty batch). Results are within the dtype's rounding tolerance of float64
(half_cases.check_against_float64 says why), and the same bits under every plan.
"""

from __future__ import annotations

import pytest
from embedding_cases import OPTIMIZERS
from half_cases import (
    DTYPES,
    assert_same_bits_across_plans,
    check_against_float64,
    train_half,
)

from manualpar.testing import run_distributed

PLANS = ("table_wise", "row_wise", "column_wise", "data_parallel")


@pytest.mark.timeout(120)
def test_every_optimizer_dtype_and_plan_within_rounding_of_float64_on_2_ranks():
    cases = [(p, o, d) for d in DTYPES for o in OPTIMIZERS for p in PLANS]
    batch_sizes = [5, 3]
    per_rank = run_distributed(train_half, 2, args=(cases, batch_sizes))
    check_against_float64(per_rank, cases, batch_sizes)
    for results in per_rank:
        assert_same_bits_across_plans(results, cases)


@pytest.mark.timeout(120)
def test_uneven_splits_on_3_ranks_same_bits_as_table_wise():
    cases = [(p, o, "bf16") for o in OPTIMIZERS for p in ("mixed", "table_wise")]
    cases += [("mixed", o, "fp16") for o in ("rowwise", "adam")]
    batch_sizes = [4, 0, 7]  # rank 1 has an empty batch and still joins every collective
    per_rank = run_distributed(train_half, 3, args=(cases, batch_sizes))
    check_against_float64(per_rank, cases, batch_sizes)
    assert_same_bits_across_plans(per_rank[0], cases)


@pytest.mark.timeout(120)
def test_torch_path_without_the_kernels_within_rounding_of_float64_on_2_ranks():
    # what CUDA tensors and hosts without a compiler run: the same rounding bits, drawn by torch
    cases = [("row_wise", o, "bf16") for o in OPTIMIZERS] + [("column_wise", "rowwise", "fp16")]
    batch_sizes = [5, 3]
    per_rank = run_distributed(
        train_half, 2, args=(cases, batch_sizes), env={"MANUALPAR_NATIVE_KERNELS": "0"}
    )
    check_against_float64(per_rank, cases, batch_sizes)
