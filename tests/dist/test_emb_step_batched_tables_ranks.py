"""The table batch (step/batched_tables.py) against the per-table step: the same bits.

Tables of mixed sizes and dims, bags with several ids, duplicates and empty bags: outputs, rows
and row-wise Adagrad state after a few steps equal bit for bit, on one process and on 2 ranks
(table-, row- and column-wise blocks side by side, so both exchange directions and the own/rest
update passes run batched).
"""

from __future__ import annotations

import pytest
import torch
from support.embedding_cases import feature_bags

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    column_wise,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.kernels.native import native_kernels
from manualpar.testing import run_distributed

SIZES = ((50, 4), (300, 16), (7, 8), (1000, 12), (120, 16))
STEPS = 3

needs_kernels = pytest.mark.skipif(native_kernels() is None, reason="no C++ kernels")


def _tables(dtype: torch.dtype) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(f"t{i}", rows, dim, feature_names=(f"f{i}",), dtype=dtype)
        for i, (rows, dim) in enumerate(SIZES)
    ]


def _batch(rank: int, step: int, batch: int) -> SparseFeatures:
    """Bags of 0-3 ids (empty ones included), many repeats within and across bags."""
    return feature_bags(SIZES, 97 * rank + step, batch, lengths=(0, 4), id_cap=20)


def _train(
    strategy: mp.ManualParallelStrategy,
    plan: EmbeddingPlan | str,
    dtype: torch.dtype,
    batched: bool,
    batch: int,
) -> dict[str, torch.Tensor]:
    with mp.empty_init():
        ebc = EmbeddingBagCollection(_tables(dtype), seed=3)
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.1, eps=1e-8))
    emb.step.batches_tables = batched
    taken = []
    phases = emb.step.forward_phases
    lookup = phases._lookup_batched
    phases._lookup_batched = lambda *a: taken.append(1) or lookup(*a)  # type: ignore[method-assign]
    result = {}
    for step in range(STEPS):
        out = emb(_batch(strategy.rank, step, batch)).values
        result[f"out{step}"] = out.detach().clone()
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    with full_tensors():
        weights = emb.state_dict()
        state = emb.fused_optimizer.state_dict()["state"]
    for name in (f"t{i}" for i in range(len(SIZES))):
        result[name] = weights[f"tables.{name}.weight"]
        result[f"{name}/sum"] = state[name]["sum"]
    result["batched steps"] = torch.tensor(len(taken))
    return result


def _compare(batched: dict[str, torch.Tensor], per_table: dict[str, torch.Tensor]) -> None:
    assert int(batched.pop("batched steps")) == STEPS
    assert int(per_table.pop("batched steps")) == 0
    for key, value in per_table.items():
        assert batched[key].dtype == value.dtype
        assert torch.equal(batched[key], value), f"{key} differs"


@needs_kernels
def test_batched_tables_give_the_per_table_bits_on_one_process() -> None:
    strategy = mp.ManualParallelStrategy()
    plan = EmbeddingPlan(1, {f"t{i}": table_wise(0) for i in range(len(SIZES))})
    dtype = torch.float32
    _compare(_train(strategy, plan, dtype, True, 6), _train(strategy, plan, dtype, False, 6))


def _on_rank(dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    strategy = mp.ManualParallelStrategy()
    plan = EmbeddingPlan(
        2,
        {
            "t0": table_wise(0),
            "t1": row_wise(),
            "t2": table_wise(1),
            "t3": column_wise([0, 1]),
            "t4": table_wise(1),
        },
    )
    batch = 5 if strategy.rank == 0 else 3  # uneven batches: other senders' scales differ
    runs = [_train(strategy, plan, dtype, batched, batch) for batched in (True, False)]
    _replaced_mid_step(strategy, plan)
    strategy.teardown()
    return runs


def _replaced_mid_step(strategy: mp.ManualParallelStrategy, plan: EmbeddingPlan) -> None:
    """A weight replaced between a step's forward and its backward on every rank (step/
    weight_guard.py): every rank's backward raises after the gradient exchange, before any
    update, and the next step runs on every rank (no collective left half done). Replaced on
    rank 1 alone (either path), rank 0 updated its rows and stopped at its next collective's
    timeout: its flag now tells every rank, which all raise rank 1's error."""
    with mp.empty_init():
        ebc = EmbeddingBagCollection(_tables(torch.float32), seed=3)
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.1))
    for batched, on in ((True, (0, 1)), (True, (1,)), (False, (1,))):
        emb.step.batches_tables = batched
        emb(_batch(strategy.rank, 0, 4)).values.sum().backward()
        loss = emb(_batch(strategy.rank, 1, 4)).values.sum()
        before = [table.weight.detach().clone() for table in emb.tables.values()]
        table = emb.tables["t1"]  # row-wise: a block on every rank
        if strategy.rank in on:
            table.weight = torch.nn.Parameter(table.weight.detach().clone())
        with pytest.raises(mp.errors.BuilderError) as raised:
            loss.backward()
        message = str(raised.value)
        assert f"'t1' on rank {on[-1]}: its weight was replaced between this step's" in message
        assert message.endswith("(every rank stops at this backward: none updated a row)")
        for old, now in zip(before, emb.tables.values(), strict=True):
            assert torch.equal(old, now.weight), "a row was updated"
        emb(_batch(strategy.rank, 2, 4)).values.sum().backward()


@needs_kernels
@pytest.mark.timeout(120)
def test_batched_tables_give_the_per_table_bits_on_2_ranks() -> None:
    runs = run_distributed(_on_rank, 2, args=(torch.float32,), collective_timeout=20)
    for batched, per_table in runs:
        _compare(batched, per_table)


@needs_kernels
def test_an_undone_batched_update_puts_every_table_back() -> None:
    """The Trainer's undo journal copies the rows a batched step touches, table by table."""
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        ebc = EmbeddingBagCollection(_tables(torch.float32), seed=3)
    plan = EmbeddingPlan(1, {f"t{i}": table_wise(0) for i in range(len(SIZES))})
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.1))
    emb.step.batches_tables = True
    assert emb.step.forward_phases.batched.usable
    emb(_batch(0, 0, 6)).values.sum().backward()  # state no longer zero

    def rows() -> dict[str, torch.Tensor]:
        return {name: table.weight.detach().clone() for name, table in emb.tables.items()}

    before = rows()
    state = {k: v["sum"].clone() for k, v in emb.fused_optimizer.table_state.items()}
    emb.hold_updates()
    emb(_batch(0, 1, 6)).values.sum().backward()
    assert not all(torch.equal(v, rows()[k]) for k, v in before.items())
    assert emb.undo_updates() == 1
    for key, value in rows().items():
        assert torch.equal(value, before[key]), key
    for name, value in state.items():
        assert torch.equal(emb.fused_optimizer.table_state[name]["sum"], value), name


@needs_kernels
def test_by_default_small_tables_take_the_batch_and_large_ones_do_not() -> None:
    """batches_tables None (the default): a step batches where its tables are small (ids times
    width per table up to BatchedTables.SMALL), takes the per-table path above."""
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        ebc = EmbeddingBagCollection(_tables(torch.float32), seed=3)
    plan = EmbeddingPlan(1, {f"t{i}": table_wise(0) for i in range(len(SIZES))})
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.1))
    assert emb.step.batches_tables is None
    taken = []
    phases = emb.step.forward_phases
    lookup = phases._lookup_batched
    phases._lookup_batched = lambda *a: taken.append(1) or lookup(*a)  # type: ignore[method-assign]
    emb(_batch(0, 0, 6)).values.sum().backward()
    assert taken == [1]
    phases.batched.SMALL = 1  # as if the tables were large
    emb(_batch(0, 1, 6)).values.sum().backward()
    assert taken == [1]
    emb.step.batches_tables = True  # forced: whatever the size
    emb(_batch(0, 2, 6)).values.sum().backward()
    assert taken == [1, 1]
