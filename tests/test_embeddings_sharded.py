"""shard_embeddings on real gloo processes against the single-process reference.

Every plan appears in one mixed plan (table-wise, row-wise, column-wise, table-row-wise and
data-parallel tables side by side), run with each fused optimizer: forward output of the first
step, then the tables *and the optimizer state* after 3 steps, equal to the reference. Row-wise
Adagrad's first update barely depends on the gradient's scale, so a wrong averaging rule shows
only in its state. Batches differ in size per rank, have empty bags and duplicate ids.
"""

from __future__ import annotations

import pytest
import torch

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingPlan,
    column_wise,
    data_parallel,
    row_wise,
    shard_embeddings,
    table_row_wise,
    table_wise,
)
from manualpar.testing import run_distributed
from tests.embedding_cases import (
    SEED,
    STEPS,
    TABLES,
    assert_close,
    local_loss,
    make_batch,
    optimizer,
    reference,
)

OPTIMIZERS = ("sgd", "adagrad", "rowwise", "adam")


def mixed_plan(world: int) -> EmbeddingPlan:
    return EmbeddingPlan(
        world,
        {
            "t0": table_wise(world - 1),
            "t1": row_wise(),
            "t2": column_wise(tuple(reversed(range(world)))),
            "t3": data_parallel(),
            "t4": table_row_wise(0, world),
            "t5": column_wise((0, world - 1)) if world > 1 else table_wise(0),
        },
    )


def uniform_plan(kind: str, world: int) -> EmbeddingPlan:
    make = {
        "table_wise": lambda i: table_wise(i % world),
        "row_wise": lambda i: row_wise(),
        "column_wise": lambda i: column_wise(tuple(range(world))),
        "table_row_wise": lambda i: table_row_wise(0, world),
        "data_parallel": lambda i: data_parallel(),
    }[kind]
    return EmbeddingPlan(world, {t.name: make(i) for i, t in enumerate(TABLES)})


def train_sharded(
    plans: list[EmbeddingPlan],
    opt_names: list[str],
    batch_sizes: list[int],
    weighted: bool,
    normalize: str = "world",
) -> list[dict]:
    """On each rank: for every (plan, optimizer), train STEPS steps; return full tensors."""
    strategy = mp.ManualParallelStrategy()
    rank = strategy.rank
    results = []
    for plan, opt_name in zip(plans, opt_names, strict=True):
        with mp.empty_init():
            ebc = EmbeddingBagCollection(TABLES, seed=SEED)
        emb = shard_embeddings(ebc, strategy, plan, optimizer(opt_name), normalize_by=normalize)
        first = None
        for step in range(STEPS):
            pooled = emb(make_batch(rank, step, batch_sizes[rank], weighted)).values
            if step == 0:
                first = pooled.detach().clone()
            local_loss(pooled, rank, step).backward()
        with full_tensors():
            weights = {k.split(".")[1]: v for k, v in emb.state_dict().items()}
            state = emb.fused_optimizer.state_dict()["state"]
        results.append({"first": first, "tables": weights, "state": state})
    strategy.teardown()
    return results


def check_against_reference(
    per_rank: list[list[dict]],
    opt_names: list[str],
    batch_sizes: list[int],
    weighted: bool,
    label: list[str],
    normalize: str = "world",
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


def test_single_process_fused_optimizers_match_torch():
    """World size 1: the same module is the unsharded collection with a fused optimizer."""
    strategy = mp.ManualParallelStrategy()
    for opt_name in OPTIMIZERS:
        ebc = EmbeddingBagCollection(TABLES, seed=SEED)
        emb = shard_embeddings(ebc, strategy, "auto", optimizer(opt_name))
        first = None
        for step in range(STEPS):
            pooled = emb(make_batch(0, step, 5)).values
            first = pooled.detach().clone() if step == 0 else first
            local_loss(pooled, 0, step).backward()
        ref_first, ref_tables, ref_state = reference(opt_name, [5])
        assert_close(first, ref_first[0], f"{opt_name}: output")
        with full_tensors():
            weights = emb.state_dict()
            state = emb.fused_optimizer.state_dict()["state"]
        for name, expected in ref_tables.items():
            assert_close(weights[f"tables.{name}.weight"], expected, f"{opt_name}: {name}")
            for key, value in ref_state[name].items():
                assert_close(state[name][key], value, f"{opt_name}: state {name}/{key}")


def test_meta_built_shard_equals_unsharded_initial_values():
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        ebc = EmbeddingBagCollection(TABLES, seed=SEED)
    assert all(p.is_meta for p in ebc.parameters())
    emb = shard_embeddings(ebc, strategy, {t.name: table_wise(0) for t in TABLES}, optimizer("sgd"))
    reference_ebc = EmbeddingBagCollection(TABLES, seed=SEED)
    for name, table in reference_ebc.tables.items():
        assert torch.equal(emb.tables[name].weight, table.weight)
