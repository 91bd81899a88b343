"""Non-finite gradients never reach the rows (reliability row 76): a NaN in one rank's loss
stops the update on every rank before any row changes ("raise"), or drops that step's sparse
update everywhere and counts it ("skip"), leaving the tables bit for bit those of a run without
the step. Each rank's flag rides in the gradient all_to_all, so no all_reduce of its own
runs (its half-row-guarded and 2-D mesh cases: test_emb_step_half_overflow_ranks.py)."""

from __future__ import annotations

import torch
from tiny_tables import tiny_tables

import manualpar as mp
from manualpar import full_tensors
from manualpar.embeddings import (
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.errors import NonFiniteError
from manualpar.testing import run_distributed


def _batch(step: int, rank: int) -> SparseFeatures:
    g = torch.Generator().manual_seed(10 * step + rank)
    return SparseFeatures.from_dict(
        {
            "user": [torch.randint(0, 10, (2,), generator=g).tolist() for _ in range(3)],
            "item": [torch.randint(0, 5, (1,), generator=g).tolist() for _ in range(3)],
            "last_item": [[], [1], [4]],
        }
    )


def _train(mode: str, steps: list[int], nan_step: int | None) -> dict:
    strategy = mp.ManualParallelStrategy()
    plan = {"user": row_wise(), "item": table_wise(1)}
    ebc = mp.EmbeddingBagCollection(tiny_tables(), seed=4)
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.1), non_finite=mode)
    reductions = []  # the flags ride in the gradient all_to_all: no all_reduce of their own
    all_reduce_async = strategy.all_reduce_async

    def counted(*args: object, **kwargs: object) -> object:
        reductions.append(kwargs.get("name"))
        return all_reduce_async(*args, **kwargs)  # type: ignore[arg-type]

    strategy.all_reduce_async = counted  # type: ignore[method-assign]
    error = None
    for step in steps:
        loss = emb(_batch(step, strategy.rank)).values.square().sum()
        if step == nan_step and strategy.rank == 1:
            loss = loss * float("nan")
        try:
            loss.backward()
        except NonFiniteError as raised:
            error = str(raised)
            break
    with full_tensors():
        tables = {k: v.clone() for k, v in emb.state_dict().items()}
    result = {
        "error": error,
        "tables": tables,
        "skipped": emb.skipped_updates,
        "updates": emb.fused_optimizer.num_updates,
        "reductions": reductions,
    }
    strategy.teardown()
    return result


def test_a_nan_on_one_rank_stops_every_rank_before_any_row_changes() -> None:
    stopped = run_distributed(_train, 2, args=("raise", [0, 1, 2], 1), timeout=60)
    before = run_distributed(_train, 2, args=("raise", [0], None), timeout=60)
    # rank 1's whole (3 samples x (4 + 4 + 4)) output gradient is NaN: user 3 x 4, item
    # (two features) 3 x 8
    expected = (
        "shard_embeddings: update 2: the output gradient holds 36 non-finite values (NaN or inf;"
        " by table: 'user': 12, 'item': 24) from rank 1; no table row or optimizer state was "
        "changed on any rank."
    )
    for rank in range(2):
        assert stopped[rank]["error"].startswith(expected), stopped[rank]["error"]
        assert "non_finite='skip'" in stopped[rank]["error"]
        assert stopped[rank]["updates"] == 1  # the refused update was not counted
        assert stopped[rank]["reductions"] == []  # every flag rode with the gradients
        for key, value in before[rank]["tables"].items():
            assert torch.equal(stopped[rank]["tables"][key], value), key


def test_skip_drops_the_step_on_every_rank_and_counts_it() -> None:
    skipped = run_distributed(_train, 2, args=("skip", [0, 1, 2], 1), timeout=60)
    without = run_distributed(_train, 2, args=("skip", [0, 2], None), timeout=60)
    for rank in range(2):
        assert skipped[rank]["error"] is None
        assert (skipped[rank]["skipped"], skipped[rank]["updates"]) == (1, 2)
        assert skipped[rank]["reductions"] == []
        assert without[rank]["skipped"] == 0
        for key, value in without[rank]["tables"].items():
            assert torch.equal(skipped[rank]["tables"][key], value), key
