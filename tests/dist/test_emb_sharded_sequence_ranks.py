"""Sharded sequence embeddings on real gloo processes against the single-process reference.

Table-wise, row-wise and column-wise plans, each with every fused optimizer, and a mixed plan
(data-parallel and table-row-wise tables too) with normalize_by="global_samples": each rank's
step-0 rows per feature, then the tables and the optimizer state after 3 steps, equal to the
unsharded EmbeddingCollection trained by torch. Ranks have different batch sizes and features
different id counts (so each rank pads differently), empty histories and duplicate ids.
A checkpoint saved by 2 ranks loads on 1 rank and, under another plan, continues training to the
reference's result; a weighted batch on one rank stops both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from embedding_cases import OPTIMIZERS, SEED, STEPS, assert_close, optimizer
from sequence_cases import FEATURES, TABLES, local_loss, make_batch, plan_named, reference

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import EmbeddingCollection, SparseFeatures, shard_embeddings
from manualpar.testing import run_distributed

BATCHES = [5, 3]


def train_sharded(
    runs: list[tuple[str, str, str]], batch_sizes: list[int], steps: int = STEPS
) -> list[dict]:
    """On each rank, for every (plan, optimizer, normalize_by): train `steps` steps; return the
    step-0 rows and the full tables and optimizer state."""
    strategy = mp.ManualParallelStrategy()
    rank, batch = strategy.rank, batch_sizes[strategy.rank]
    results = []
    for plan, opt_name, normalize in runs:
        with mp.empty_init():
            ec = EmbeddingCollection(TABLES, seed=SEED)
        emb = shard_embeddings(
            ec,
            strategy,
            plan_named(plan, strategy.world_size),
            optimizer(opt_name),
            normalize_by=normalize,
        )
        first = {}
        for step in range(steps):
            out = emb(make_batch(rank, step, batch))
            if step == 0:
                first = {k: v.values.detach().clone() for k, v in out.to_dict().items()}
            local_loss(out, rank, step, batch).backward()
        with full_tensors():
            tables = {k.split(".")[1]: v for k, v in emb.state_dict().items()}
            state = emb.fused_optimizer.state_dict()["state"]
        results.append({"first": first, "tables": tables, "state": state})
    strategy.teardown()
    return results


def check(per_rank: list[list[dict]], runs: list[tuple[str, str, str]], batches: list[int]) -> None:
    for index, (plan, opt_name, normalize) in enumerate(runs):
        ref_first, ref_tables, ref_state = reference(opt_name, batches, normalize)
        for rank, results in enumerate(per_rank):
            got, where = results[index], f"{plan}, {opt_name}, {normalize}, rank {rank}"
            assert set(got["first"]) == set(ref_first[rank]), where
            for feature, rows in ref_first[rank].items():
                assert_close(got["first"][feature], rows, f"{where}: step-0 rows of {feature}")
            for name, expected in ref_tables.items():
                assert_close(got["tables"][name], expected, f"{where}: table {name}")
                for key, value in ref_state[name].items():
                    assert_close(got["state"][name][key], value, f"{where}: state {name}/{key}")


@pytest.mark.timeout(180)
def test_table_row_and_column_wise_with_every_optimizer_match_reference_on_2_ranks():
    runs = [
        (plan, opt, "world_size")
        for plan in ("table_wise", "row_wise", "column_wise")
        for opt in OPTIMIZERS
    ]
    check(run_distributed(train_sharded, 2, args=(runs, BATCHES)), runs, BATCHES)


@pytest.mark.timeout(120)
def test_mixed_plan_with_global_sample_normalization_on_2_ranks():
    runs = [("mixed", "rowwise", "global_samples"), ("mixed", "adam", "global_samples")]
    batches = [2, 6]  # unequal shares: a wrong weighting shows in the tables and the state
    check(run_distributed(train_sharded, 2, args=(runs, batches)), runs, batches)


def checkpoint_job(plan: str, steps: range, load: str | None, save: str | None) -> dict:
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():  # a job that loads starts from other values
        ec = EmbeddingCollection(TABLES, seed=SEED + 1 if load else SEED)
    emb = shard_embeddings(
        ec, strategy, plan_named(plan, strategy.world_size), optimizer("rowwise")
    )
    state = {"model": emb, "sparse_optim": emb.fused_optimizer}
    if load:
        strategy.load_checkpoint(load, state)
    for step in steps:
        out = emb(make_batch(strategy.rank, step, BATCHES[strategy.rank]))
        local_loss(out, strategy.rank, step, BATCHES[strategy.rank]).backward()
    if save:
        strategy.save_checkpoint(save, state)
        strategy.save_checkpoint(save + ".full.pt", state, full=True)
    with full_tensors():
        tables = {k.split(".")[1]: v for k, v in emb.state_dict().items()}
        optim = emb.fused_optimizer.state_dict()
    strategy.teardown()
    return {"tables": tables, "state": optim["state"], "step": optim["step"]}


@pytest.mark.timeout(180)
def test_checkpoint_saved_on_2_ranks_loads_on_1_and_reshards(tmp_path: Path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(checkpoint_job, 2, args=("row_wise", range(2), None, ckpt))[0]
    # 2 ranks row-wise -> 1 rank table-wise: exactly the saved tables and row-wise state
    loaded = run_distributed(checkpoint_job, 1, args=("table_wise", range(0), ckpt, None))[0]
    assert loaded["step"] == saved["step"] == 2
    for name, table in saved["tables"].items():
        assert torch.equal(loaded["tables"][name], table), f"2 -> 1: table {name}"
        assert torch.equal(loaded["state"][name]["sum"], saved["state"][name]["sum"]), name
    # the full export loads into the unsharded collection
    ec = EmbeddingCollection(TABLES, seed=SEED + 1)
    ec.load_state_dict(torch.load(ckpt + ".full.pt", weights_only=True)["model"])
    for name, table in saved["tables"].items():
        assert torch.equal(ec.tables[name].weight.detach(), table), f"full export: table {name}"
    # 2 ranks row-wise -> 2 ranks column-wise, one more step: the reference's 3-step result
    _, ref_tables, ref_state = reference("rowwise", BATCHES)
    for rank, result in enumerate(
        run_distributed(checkpoint_job, 2, args=("column_wise", range(2, 3), ckpt, None))
    ):
        for name, expected in ref_tables.items():
            assert_close(result["tables"][name], expected, f"rank {rank}: table {name}")
            assert_close(result["state"][name]["sum"], ref_state[name]["sum"], f"state {name}")


def _weighted_on_rank_1() -> None:
    strategy = mp.ManualParallelStrategy()
    emb = shard_embeddings(
        EmbeddingCollection(TABLES, seed=SEED),
        strategy,
        plan_named("row_wise", 2),
        optimizer("sgd"),
    )
    batch = make_batch(strategy.rank, 0, 3)
    if strategy.rank == 1:
        batch = SparseFeatures(
            batch.keys, batch.values, batch.lengths, torch.ones(batch.values.shape)
        )
    emb(batch)


@pytest.mark.timeout(60)
def test_weighted_batch_on_one_rank_stops_both_ranks_at_that_step():
    outcomes = run_distributed(
        _weighted_on_rank_1, 2, timeout=45, collective_timeout=20, allow_failure=True
    )
    bad, peer = outcomes[1], outcomes[0]
    assert bad.error_type == "EmbeddingInputError", bad.describe()
    assert "carry per-id weights, but sequence embeddings return one row per id" in bad.error
    assert peer.error_type == "EmbeddingInputError", peer.describe()
    assert peer.error.startswith("rank 1 refused its batch"), peer.error


def compact_against_padded(batch_sizes: list[int]) -> dict:
    """Row-wise on every rank: the same steps with the compact exchange (the default) and the
    padded one; per run, the step-0 rows, tables after 3 steps, and the floats this rank
    received in each pooled-output exchange."""
    strategy = mp.ManualParallelStrategy()
    rank, batch = strategy.rank, batch_sizes[strategy.rank]
    out: dict = {}
    for compact in (True, False):
        with mp.empty_init():
            ec = EmbeddingCollection(TABLES, seed=SEED)
        emb = shard_embeddings(
            ec, strategy, plan_named("row_wise", strategy.world_size), optimizer("rowwise")
        )
        if not compact:
            emb.step.parts.layout.send_every_bag()
        received: list[int] = []
        exchange = emb.step.parts.exchange

        def counting(tensor, send, receive, what, exchange=exchange, received=received):
            if what == "pooled output":
                received.append(sum(receive))
            return exchange(tensor, send, receive, what)

        emb.step.parts.__dict__["exchange"] = counting  # StepParts is frozen: bypass it
        first = {}
        for step in range(STEPS):
            features = make_batch(rank, step, batch)
            rows = emb(features)
            if step == 0:
                first = {k: v.values.detach().clone() for k, v in rows.to_dict().items()}
                ids = features
            local_loss(rows, rank, step, batch).backward()
        with full_tensors():
            tables = {k: v.clone() for k, v in emb.state_dict().items()}
        out[compact] = {"first": first, "tables": tables, "received": received, "ids": ids}
    strategy.teardown()
    return out


@pytest.mark.timeout(120)
def test_row_wise_sequences_exchange_only_each_ids_owner_row_on_3_ranks():
    per_rank = run_distributed(compact_against_padded, 3, args=([4, 2, 3],))
    dims = {f: t.embedding_dim for t in TABLES for f in t.feature_names}
    rows_of = {f: t.num_embeddings for t in TABLES for f in t.feature_names}
    for rank, runs in enumerate(per_rank):
        compact, padded = runs[True], runs[False]
        for feature, rows in padded["first"].items():  # bit for bit
            assert torch.equal(compact["first"][feature], rows), (rank, feature)
        for name, table in padded["tables"].items():
            assert torch.equal(compact["tables"][name], table), (rank, name)
        # step 0: each other owner sent one row per id of ours it holds, nothing for the rest
        features = compact["ids"]
        expected = 0
        for feature in FEATURES:
            block = -(-rows_of[feature] // 3)  # row-wise blocks of ceil(rows / 3)
            owners = features[feature].values // block
            expected += int((owners != rank).sum()) * dims[feature]
        assert compact["received"][0] == expected, rank
        assert padded["received"][0] > expected, rank
