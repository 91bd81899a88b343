"""shard_embeddings on real gloo processes against the single-process reference.

Every plan appears in one mixed plan (table-wise, row-wise, column-wise, table-row-wise and
data-parallel tables side by side), run with each fused optimizer: forward output of the first
step, then the tables *and the optimizer state* after 3 steps, equal to the reference. Row-wise
Adagrad's first update barely depends on the gradient's scale, so a wrong averaging rule shows
only in its state. Batches differ in size per rank, have empty bags and duplicate ids.
"""

from __future__ import annotations

import pytest
from embedding_cases import (
    OPTIMIZERS,
    SEED,
    TABLES,
    assert_close,
    mixed_plan,
    optimizer,
    reference,
    train_and_collect,
    uniform_plan,
)

import manualpar as mp
from manualpar.embeddings import EmbeddingBagCollection, EmbeddingPlan, shard_embeddings
from manualpar.testing import run_distributed


def train_sharded(
    plans: list[EmbeddingPlan],
    opt_names: list[str],
    batch_sizes: list[int],
    weighted: bool,
    normalize: str = "world_size",
) -> list[dict]:
    """On each rank: for every (plan, optimizer), train STEPS steps; return full tensors."""
    strategy = mp.ManualParallelStrategy()
    rank = strategy.rank
    results = []
    for plan, opt_name in zip(plans, opt_names, strict=True):
        with mp.empty_init():
            ebc = EmbeddingBagCollection(TABLES, seed=SEED)
        emb = shard_embeddings(ebc, strategy, plan, optimizer(opt_name), normalize_by=normalize)
        results.append(train_and_collect(emb, rank, batch_sizes[rank], weighted))
    strategy.teardown()
    return results


def check_against_reference(
    per_rank: list[list[dict]],
    opt_names: list[str],
    batch_sizes: list[int],
    weighted: bool,
    label: list[str],
    normalize: str = "world_size",
) -> None:
    for index, opt_name in enumerate(opt_names):
        ref_first, ref_tables, ref_state = reference(opt_name, batch_sizes, weighted, normalize)
        for rank, results in enumerate(per_rank):
            got = results[index]
            where = f"{label[index]}, rank {rank}"
            assert_close(got["first"], ref_first[rank], f"{where}: step-0 output")
            for name, expected in ref_tables.items():
                assert_close(got["tables"][name], expected, f"{where}: table {name}")
                for key, value in ref_state[name].items():
                    assert_close(got["state"][name][key], value, f"{where}: state {name}/{key}")


@pytest.mark.timeout(120)
def test_every_plan_and_optimizer_matches_reference_on_2_ranks():
    batch_sizes = [5, 3]
    plans = [mixed_plan(2)] * len(OPTIMIZERS)
    per_rank = run_distributed(train_sharded, 2, args=(plans, list(OPTIMIZERS), batch_sizes, False))
    check_against_reference(
        per_rank, list(OPTIMIZERS), batch_sizes, False, [f"mixed plan, {o}" for o in OPTIMIZERS]
    )


@pytest.mark.timeout(120)
def test_each_uniform_plan_weighted_ids_on_2_ranks():
    kinds = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
    opts = ["rowwise", "adam", "rowwise", "adagrad", "sgd"]
    batch_sizes = [4, 6]
    per_rank = run_distributed(
        train_sharded, 2, args=([uniform_plan(k, 2) for k in kinds], opts, batch_sizes, True)
    )
    check_against_reference(
        per_rank,
        opts,
        batch_sizes,
        True,
        [f"{k}, {o}, weighted" for k, o in zip(kinds, opts, strict=True)],
    )


@pytest.mark.timeout(120)
def test_uneven_row_and_column_splits_on_3_ranks_with_global_sample_normalization():
    opts = ["rowwise", "adam"]
    batch_sizes = [4, 0, 7]  # rank 1 has an empty batch and still joins every collective
    per_rank = run_distributed(
        train_sharded, 3, args=([mixed_plan(3)] * 2, opts, batch_sizes, False, "global_samples")
    )
    check_against_reference(
        per_rank,
        opts,
        batch_sizes,
        False,
        [f"mixed plan on 3 ranks, {o}" for o in opts],
        "global_samples",
    )
