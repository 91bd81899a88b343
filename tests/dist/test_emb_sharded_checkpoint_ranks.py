"""Sharded embedding checkpoints reshard across world sizes and plans, optimizer state included.

A job trains 2 steps under one plan and saves through the strategy; other jobs load it under
other plans and world sizes (2 -> 1, 1 -> 2, 2 -> 3; table-wise -> row-wise, row-wise ->
column-wise) and must hold exactly the saved tables and optimizer state. One of them continues
training for the third step and must land on the single-process reference's 3-step result.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from embedding_cases import (
    SEED,
    TABLES,
    assert_close,
    local_loss,
    make_batch,
    mixed_plan,
    optimizer,
    reference,
    uniform_plan,
)

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingPlan,
    shard_embeddings,
)
from manualpar.testing import run_distributed

BATCHES = [5, 3]


def plan_named(name: str, world: int) -> EmbeddingPlan:
    return mixed_plan(world) if name == "mixed" else uniform_plan(name, world)


def job(
    plan: str,
    opt_name: str,
    steps: range,
    load: str | None,
    save: str | None,
    full_export: str | None = None,
) -> dict:
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        # a job that loads starts from other values: loading must replace every one of them
        ebc = EmbeddingBagCollection(TABLES, seed=SEED + 1 if load else SEED)
    emb = shard_embeddings(
        ebc, strategy, plan_named(plan, strategy.world_size), optimizer(opt_name)
    )
    state = {"model": emb, "sparse_optim": emb.fused_optimizer}
    if load:
        strategy.load_checkpoint(load, state)
    for step in steps:
        pooled = emb(make_batch(strategy.rank, step, BATCHES[strategy.rank])).values
        local_loss(pooled, strategy.rank, step).backward()
    if save:
        strategy.save_checkpoint(save, state)
    if full_export:
        strategy.save_checkpoint(full_export, state, full=True)
    with full_tensors():
        tables = {k.split(".")[1]: v for k, v in emb.state_dict().items()}
        optim = emb.fused_optimizer.state_dict()
    strategy.teardown()
    return {"tables": tables, "state": optim["state"], "step": optim["step"]}


def assert_same(got: dict, expected: dict, what: str) -> None:
    assert got["step"] == expected["step"], what
    for name, tensor in expected["tables"].items():
        assert torch.equal(got["tables"][name], tensor), f"{what}: table {name}"
        for key, value in expected["state"][name].items():
            assert torch.equal(got["state"][name][key], value), f"{what}: state {name}/{key}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("opt_name", ["rowwise", "adam"])
def test_reshard_across_world_sizes_and_plans(tmp_path: Path, opt_name: str):
    ckpt, full = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    saved = run_distributed(job, 2, args=("mixed", opt_name, range(2), None, ckpt, full))[0]
    # 2 -> 1 (everything table-wise on one rank)
    assert_same(
        run_distributed(job, 1, args=("table_wise", opt_name, range(0), ckpt, None))[0],
        saved,
        "2 -> 1",
    )
    # 2 -> 3, row-wise with uneven row blocks
    for result in run_distributed(job, 3, args=("row_wise", opt_name, range(0), ckpt, None)):
        assert_same(result, saved, "2 -> 3 row-wise")
    # the full export holds one plain tensor per table and state; it loads into column-wise
    blob = torch.load(full, weights_only=True)
    assert torch.equal(blob["model"]["tables.t1.weight"], saved["tables"]["t1"])
    for result in run_distributed(job, 2, args=("column_wise", opt_name, range(0), full, None)):
        assert_same(result, saved, "full export -> 2 column-wise")


@pytest.mark.timeout(180)
def test_resharded_training_continues_like_the_reference(tmp_path: Path):
    """table-wise (1 rank) -> row-wise (2 ranks) -> column-wise (2 ranks) + one more step."""
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    run_distributed(job, 2, args=("table_wise", "rowwise", range(1), None, first))
    run_distributed(job, 2, args=("row_wise", "rowwise", range(1, 2), first, second))
    results = run_distributed(job, 2, args=("column_wise", "rowwise", range(2, 3), second, None))
    _, ref_tables, ref_state = reference("rowwise", BATCHES)
    for rank, result in enumerate(results):
        for name, expected in ref_tables.items():
            assert_close(result["tables"][name], expected, f"rank {rank}: table {name}")
            assert_close(
                result["state"][name]["sum"],
                ref_state[name]["sum"],
                f"rank {rank}: row-wise state {name}",
            )


@pytest.mark.timeout(120)
def test_one_to_two_ranks(tmp_path: Path):
    ckpt = str(tmp_path / "one")
    strategy = mp.ManualParallelStrategy()
    emb = shard_embeddings(
        EmbeddingBagCollection(TABLES, seed=SEED),
        strategy,
        plan_named("table_wise", 1),
        optimizer("adagrad"),
    )
    pooled = emb(make_batch(0, 0, 4)).values
    local_loss(pooled, 0, 0).backward()
    strategy.save_checkpoint(ckpt, {"model": emb, "sparse_optim": emb.fused_optimizer})
    with full_tensors():
        saved = {
            "tables": {k.split(".")[1]: v for k, v in emb.state_dict().items()},
            "state": emb.fused_optimizer.state_dict()["state"],
            "step": 1,
        }
    for result in run_distributed(job, 2, args=("mixed", "adagrad", range(0), ckpt, None)):
        assert_same(result, saved, "1 -> 2 mixed")
