"""shard_embeddings on one process: the fused optimizers against torch's own, meta init.

The same module on world size 1 is the unsharded collection with a fused optimizer; the
multi-rank runs against the same reference are in tests/dist/test_emb_sharded_ranks.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from embedding_cases import (
    OPTIMIZERS,
    SEED,
    STEPS,
    TABLES,
    assert_close,
    local_loss,
    make_batch,
    optimizer,
    reference,
)

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    SGD,
    Adam,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    SparseFeatures,
    shard_embeddings,
    table_wise,
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


def test_normalize_by_takes_ddps_spelling_and_the_old_one() -> None:
    """`normalize_by="world_size"` as in ddp(); "world", the spelling before 0.2, still works."""
    strategy = mp.ManualParallelStrategy()
    for spelling in ("world_size", "world"):
        with (
            pytest.warns(FutureWarning, match='normalize_by="world" was renamed')
            if spelling == "world"
            else contextlib.nullcontext()
        ):
            emb = shard_embeddings(
                EmbeddingBagCollection(TABLES),
                strategy,
                "auto",
                optimizer("sgd"),
                normalize_by=spelling,
            )
        assert emb.normalize_by == emb.step.parts.normalize_by == "world_size"
    try:
        shard_embeddings(
            EmbeddingBagCollection(TABLES), strategy, "auto", optimizer("sgd"), normalize_by="ranks"
        )
    except mp.BuilderError as error:
        assert str(error) == (
            "shard_embeddings(): normalize_by must be one of ('world_size', 'global_samples'), "
            "got 'ranks'"
        )
    else:
        raise AssertionError("normalize_by='ranks' was accepted")


def test_auto_plan_defaults_to_the_memory_this_rank_can_allocate() -> None:
    """A table far larger than memory is named before anything is allocated (it was a bare
    allocator failure); an explicit budget still wins."""
    from manualpar.embeddings import EmbeddingBagConfig
    from manualpar.embeddings.kernels.row_memory import available_bytes
    from manualpar.embeddings.plan import format_bytes

    strategy = mp.ManualParallelStrategy()
    free = available_bytes(strategy.device)
    assert free is not None and free > 0
    rows = free // (65 * 4) * 4  # four times this machine's free memory, with row-wise state
    with mp.empty_init():
        ebc = EmbeddingBagCollection([EmbeddingBagConfig("huge", rows, 64)])
    try:
        shard_embeddings(ebc, strategy, "auto", optimizer("rowwise"))
    except mp.PlanError as error:
        message = str(error)
    else:
        raise AssertionError("a table 4x the free memory was planned")
    assert message.startswith(f"table 'huge' holds {format_bytes(rows * 65 * 4)} with optimizer")
    assert "(the budget is the memory each rank can allocate now, " in message
    assert message.endswith("; pass memory_budget_bytes= to plan for another amount)")
    with mp.empty_init():
        small = EmbeddingBagCollection(TABLES)
    emb = shard_embeddings(small, strategy, "auto", optimizer("rowwise"))
    assert emb.plan.world_size == 1


@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad", "adam"])
def test_an_empty_batch_trains_nothing_on_one_process(rule: str) -> None:
    """Reliability row 74: an empty batch's backward on one rank used to fail in the kernels
    (`gradient blocks must be 2-D CPU tensors with contiguous rows`); on 2 ranks it worked."""
    optimizer = {
        "sgd": SGD(lr=0.1),
        "rowwise_adagrad": RowWiseAdagrad(lr=0.1),
        "adam": Adam(lr=0.1),
    }
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", 8, 4)], seed=3)
    before = ebc.tables["t"].weight.detach().clone()
    emb = shard_embeddings(ebc, mp.ManualParallelStrategy(), "auto", optimizer[rule])
    empty = SparseFeatures(
        ["t"], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    )
    out = emb(empty).values
    assert out.shape == (0, 4)
    out.sum().backward()
    with full_tensors():
        assert torch.equal(emb.state_dict()["tables.t.weight"], before)
