"""Half rows that overflow in the update are put back and reported (on by default for half
tables; reliability row 78): a learning rate too large for float16 turns rows to inf with a
finite gradient; every rank undoes the update and raises, or under "skip" drops the step and
counts it, leaving the rows, the optimizer state and the update count bit for bit those of a
run without the step; in memory and on the disk tier, and when one rank alone overflows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import manualpar as mp
from manualpar import full_tensors
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.errors import NonFiniteError
from manualpar.testing import run_distributed

OVERFLOWING_LR = 1e6  # a row-wise Adagrad step moves each element by about lr: past 65504


def _batch(step: int, rank: int) -> SparseFeatures:
    g = torch.Generator().manual_seed(10 * step + rank)
    return SparseFeatures.from_dict(
        {
            "user": [torch.randint(0, 10, (2,), generator=g).tolist() for _ in range(3)],
            "item": [torch.randint(0, 5, (1,), generator=g).tolist() for _ in range(3)],
        }
    )


def _train(
    mode: str,
    steps: list[int],
    big_lr_step: int | None,
    disk: str | None,
    guard: bool | None = None,
) -> dict:
    strategy = mp.ManualParallelStrategy()
    tables = (
        EmbeddingBagConfig("user", 10, 4, dtype=torch.float16),
        EmbeddingBagConfig("item", 5, 4),  # float32: a mixed collection
    )
    user_plan = row_wise(on_disk=True) if disk else row_wise()
    tier = DiskTier(disk, cache_rows=4) if disk else None
    emb = shard_embeddings(
        mp.EmbeddingBagCollection(tables, seed=4),
        strategy,
        {"user": user_plan, "item": table_wise(1)},
        RowWiseAdagrad(lr=0.1),
        non_finite=mode,
        disk_tier=tier,
        guard_half_rows=guard,
    )
    return _run(strategy, emb, steps, big_lr_step)


def _run(
    strategy: mp.ManualParallelStrategy,
    emb: Any,
    steps: list[int],
    big_lr_step: int | None,
    big_lr: float = OVERFLOWING_LR,
    up: bool = False,
) -> dict:
    """Train `steps` (the learning rate `big_lr` at `big_lr_step`) until one raises; the
    tables, state and counts after. `up`: a loss whose step moves every value up by lr."""
    error = None
    for step in steps:
        emb.fused_optimizer.lr = big_lr if step == big_lr_step else 0.1
        try:
            values = emb(_batch(step, strategy.rank)).values
            (-values.sum() if up else values.square().sum()).backward()
        except NonFiniteError as raised:
            error = str(raised)
            break
    with full_tensors():
        tables_now = {k: v.clone() for k, v in emb.state_dict().items()}
        state = emb.fused_optimizer.state_dict()["state"]
        state = {f"{t}/{k}": v.clone() for t, keys in state.items() for k, v in keys.items()}
    result = {
        "error": error,
        "tables": tables_now,
        "state": state,
        "skipped": emb.skipped_updates,
        "updates": emb.fused_optimizer.num_updates,
    }
    strategy.teardown()
    return result


def _assert_same(got: dict, want: dict) -> None:
    for part in ("tables", "state"):
        assert got[part].keys() == want[part].keys()
        for key, value in want[part].items():
            assert torch.equal(got[part][key], value), key


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_overflowing_half_rows_are_undone_and_named_on_every_rank(
    tmp_path: Path, tier: str
) -> None:
    disk = [str(tmp_path / "a"), str(tmp_path / "b")] if tier == "disk" else [None, None]
    stopped = run_distributed(_train, 2, args=("raise", [0, 1, 2], 1, disk[0]), timeout=60)
    before = run_distributed(_train, 2, args=("raise", [0], None, disk[1]), timeout=60)
    for rank in range(2):
        error = stopped[rank]["error"]
        assert error is not None
        assert error.startswith("shard_embeddings: update 2: "), error
        assert "half-precision rows overflowed to inf or NaN in the update (by table: 'user': " in (
            error
        )
        assert "'item'" not in error  # float32 rows are not guarded
        assert "the update was undone on every rank" in error
        assert "float16 holds values up to 65504" in error
        assert stopped[rank]["updates"] == 1
        _assert_same(stopped[rank], before[rank])


@pytest.mark.timeout(120)
def test_skip_undoes_the_overflowing_step_and_counts_it(tmp_path: Path) -> None:
    skipped = run_distributed(_train, 2, args=("skip", [0, 1, 2], 1, None), timeout=60)
    without = run_distributed(_train, 2, args=("skip", [0, 2], None, None), timeout=60)
    for rank in range(2):
        assert skipped[rank]["error"] is None
        assert (skipped[rank]["skipped"], skipped[rank]["updates"]) == (1, 2)
        assert without[rank]["skipped"] == 0
        _assert_same(skipped[rank], without[rank])


@pytest.mark.timeout(120)
def test_without_the_guard_the_overflow_reaches_the_rows() -> None:
    """What the guard is for, and that `guard_half_rows=False` turns it off."""
    (unguarded, _) = run_distributed(_train, 2, args=("raise", [0, 1], 1, None, False), timeout=60)
    assert unguarded["error"] is None
    assert not torch.isfinite(unguarded["tables"]["tables.user.weight"]).all()


def _train_one_rank_high(steps: list[int], big_lr_step: int | None) -> dict:
    """'user' (rows near the float16 limit) on rank 0 and 'item' (small rows) on rank 1, both
    float16, default guard: a large step overflows 'user' on rank 0 alone."""
    strategy = mp.ManualParallelStrategy()
    ebc = mp.EmbeddingBagCollection(
        (
            EmbeddingBagConfig("user", 10, 4, dtype=torch.float16),
            EmbeddingBagConfig("item", 5, 4, dtype=torch.float16),
        ),
        seed=4,
    )
    with torch.no_grad():
        ebc.tables["user"].weight.fill_(60000.0)
    emb = shard_embeddings(
        ebc, strategy, {"user": table_wise(0), "item": table_wise(1)}, RowWiseAdagrad(lr=0.1)
    )
    return _run(strategy, emb, steps, big_lr_step, big_lr=1e4, up=True)


@pytest.mark.timeout(120)
def test_an_overflow_on_one_rank_undoes_the_update_on_every_rank() -> None:
    """By default: rank 0's rows overflow, rank 1's do not; both raise naming the table and
    rank 0, and both ranks' rows and state are those of a run stopped before the step."""
    stopped = run_distributed(_train_one_rank_high, 2, args=([0, 1, 2], 1), timeout=60)
    before = run_distributed(_train_one_rank_high, 2, args=([0], None), timeout=60)
    for rank in range(2):
        error = stopped[rank]["error"]
        assert error is not None
        assert "half-precision rows overflowed to inf or NaN in the update (by table: 'user': " in (
            error
        )
        assert error.split(" in the update ")[1].startswith("(by table: 'user': "), error
        assert "'item'" not in error
        assert ") on rank 0; the update was undone on every rank" in error, error
        assert stopped[rank]["updates"] == 1
        _assert_same(stopped[rank], before[rank])


COUNTED = (
    "all_reduce_async",
    "all_reduce_",
    "reduce",
    "all_gather",
    "all_gather_object",
    "all_to_all_async",
    "barrier",
    "broadcast",
)


def _collectives_of_a_step(layout: str, guard: bool | None) -> dict:
    """The strategy's collectives in one step's backward (after a first step), as (method,
    name, group given) on this rank, with the reductions' shapes apart. `layout`: "ranks",
    the float16 table on rank 0 alone and the float32 one on rank 1 (a rank without half
    rows), or "mesh", both on a 2 x 1 (replicate, shard) mesh."""
    strategy = mp.ManualParallelStrategy()
    tables = (
        EmbeddingBagConfig("user", 10, 4, dtype=torch.float16),
        EmbeddingBagConfig("item", 5, 4),
    )
    on_mesh = layout == "mesh"
    emb = shard_embeddings(
        mp.EmbeddingBagCollection(tables, seed=4),
        strategy,
        {"user": table_wise(0), "item": table_wise(0 if on_mesh else 1)},
        RowWiseAdagrad(lr=0.1),
        guard_half_rows=guard,
        mesh=strategy.mesh(replicate=2, shard=1) if on_mesh else None,
    )
    emb(_batch(0, strategy.rank)).values.square().sum().backward()
    calls: list[tuple[str, str, bool]] = []
    shapes: list[tuple[int, ...]] = []

    def counting(method: str) -> Any:
        original = getattr(strategy, method)

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append((method, str(kwargs.get("name", "")), kwargs.get("group") is not None))
            if method in ("all_reduce_async", "all_reduce_", "reduce"):
                shapes.append(tuple(torch.as_tensor(args[0]).shape))
            return original(*args, **kwargs)

        return counted

    counted = []
    for step, scale in ((1, 1.0), (2, 1e12)):  # 1e12: past what a rank rules out alone
        values = emb(_batch(step, strategy.rank)).values
        for method in COUNTED:
            setattr(strategy, method, counting(method))
        (scale * values.square().sum()).backward()
        for method in COUNTED:
            delattr(strategy, method)
        counted.append((calls[:], shapes[:]))
        calls.clear(), shapes.clear()
    guarded = emb.step.backward_phases.half_rows is not None
    updates = emb.fused_optimizer.num_updates
    strategy.teardown()
    (calls, shapes), (big, _) = counted
    return {"calls": calls, "shapes": shapes, "big": big, "guarded": guarded, "updates": updates}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["ranks", "mesh"])
def test_a_guarded_step_asks_both_questions_in_one_all_reduce(layout: str) -> None:
    """The non-finite flag and the half-row guard's answers travel together, and every rank
    issues the same collectives in the same order, with half rows or without. Where the
    gradient all_to_all reaches every rank (no replicas) the flag rides in it, guarded or not
    (each rank rules its overflow out alone under row-wise Adagrad): no all_reduce at all; on
    a mesh with replicas one small all_reduce before the update, of the same shape guarded or
    not."""
    flags = ("all_reduce_async", "shard_embeddings: non-finite gradient flag all_reduce", False)
    for guard in (None, False):
        results = run_distributed(_collectives_of_a_step, 2, args=(layout, guard), timeout=60)
        rides = layout == "ranks"
        answers = ("all_reduce_", "shard_embeddings: half-row overflow answers all_reduce", False)
        for result in results:
            assert result["guarded"] is (guard is None)
            assert result["updates"] == 3
            reductions = [c for c in result["calls"] if "reduce" in c[0]]
            assert reductions == ([] if rides else [flags]), (guard, reductions)
            assert result["shapes"] == ([] if rides else [(6,)])
            # a gradient too large to rule out alone: its rank raises the ridden flag, and
            # every rank counts (none non-finite) and sums the answers, as the all_reduce did
            big = [c for c in result["big"] if c[0] != "all_to_all_async"]
            expected = [("all_gather_object", "", False), answers] if guard is None else []
            assert big == (expected if rides else [flags]), (guard, big)
        assert results[0]["calls"] == results[1]["calls"], guard
        assert results[0]["big"] == results[1]["big"], guard
