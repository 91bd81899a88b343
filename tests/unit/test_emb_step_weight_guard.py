"""The step's weight guard (step/weight_guard.py) beyond a replacement between steps: a weight
replaced between a step's forward and its backward, a weight moved to another device, and a
disk-tier table's checkpoint saved after its weight (the row cache) was replaced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.embedding_cases import feature_bags, one_process_tables
from torch import nn

import manualpar as mp
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    SparseFeatures,
    row_wise,
    shard_embeddings,
)
from manualpar.embeddings.kernels.native import native_kernels
from manualpar.errors import BuilderError

SIZES = ((50, 4), (30, 8))


def _batch(step: int) -> SparseFeatures:
    return feature_bags(SIZES, step, 4, lengths=(1, 3))


def _sharded(batched: bool) -> ShardedEmbeddingBagCollection:
    emb = one_process_tables(SIZES)
    emb.step.batches_tables = batched
    return emb


BATCHED = [
    pytest.param(True, marks=pytest.mark.skipif(native_kernels() is None, reason="no C++ kernels")),
    False,
]


@pytest.mark.parametrize("batched", BATCHED)
@pytest.mark.parametrize("how", ["parameter", "data"])
def test_a_weight_replaced_between_forward_and_backward_stops_that_backward(
    batched: bool, how: str
) -> None:
    """The forward looked the old weight up: the table batch would update the old block (kept
    alive by it, lost to the table), the per-table path the new weight from the old lookups.
    That backward raises before any row is updated; the next step takes the new weight."""
    emb = _sharded(batched)
    emb(_batch(0)).values.sum().backward()  # a first step: the batch decided, state made
    loss = emb(_batch(1)).values.sum()
    old = {name: table.weight.detach().clone() for name, table in emb.tables.items()}
    state = emb.fused_optimizer.table_state
    before = {name: {k: v.clone() for k, v in keys.items()} for name, keys in state.items()}
    new = torch.linspace(-1, 1, 50 * 4).view(50, 4)
    if how == "parameter":
        emb.tables["t0"].weight = nn.Parameter(new.clone())
    else:
        emb.tables["t0"].weight.data = new.clone()
    with pytest.raises(BuilderError) as raised:
        loss.backward()
    message = str(raised.value)
    for part in ("'t0'", "rank 0", "between this step's forward and its backward", "between steps"):
        assert part in message, part
    assert torch.equal(emb.tables["t0"].weight, new), "the new weight was updated"
    assert torch.equal(emb.tables["t1"].weight, old["t1"]), "another table was updated"
    for name, keys in state.items():
        for key, value in keys.items():
            assert torch.equal(value, before[name][key]), f"{name}'s {key} was updated"
    emb(_batch(2)).values.sum().backward()  # the next step trains the new weight
    assert not torch.equal(emb.tables["t0"].weight, new)
    assert emb.fused_optimizer.param_groups[0]["params"][0] is emb.tables["t0"].weight


def test_a_frozen_table_replaced_between_forward_and_backward_is_not_an_error() -> None:
    """That backward updates no row of it: the others train on."""
    emb = _sharded(False)
    emb.tables["t1"].weight.requires_grad_(False)
    loss = emb(_batch(0)).values.sum()
    before = emb.tables["t0"].weight.detach().clone()
    emb.tables["t1"].weight = nn.Parameter(torch.zeros(30, 8), requires_grad=False)
    loss.backward()
    assert not torch.equal(emb.tables["t0"].weight, before)
    assert not emb.tables["t1"].weight.count_nonzero()


@pytest.mark.parametrize("batched", BATCHED)
def test_a_weight_moved_to_another_device_stops_the_next_step_naming_both(batched: bool) -> None:
    """Before: taken as a same-shape replacement (then a kernel's error, or a step on the meta
    device). The meta device stands for any other: the check compares devices, nothing CUDA's."""
    emb = _sharded(batched)
    emb(_batch(0)).values.sum().backward()
    emb.tables["t1"].weight = nn.Parameter(torch.zeros(30, 8, device="meta"))
    with pytest.raises(BuilderError) as raised:
        emb(_batch(1))
    message = str(raised.value)
    for part in ("'t1'", "rank 0", "moved from cpu to meta", "on cpu", ".to('cpu')"):
        assert part in message, part


def test_a_checkpoint_of_a_weight_moved_to_another_device_is_refused(tmp_path: Path) -> None:
    """Before: the checkpoint read the moved weight (a meta one failed inside torch's
    checkpoint; another device's rows were saved apart from their optimizer state)."""
    emb = _sharded(False)
    emb(_batch(0)).values.sum().backward()
    strategy = mp.ManualParallelStrategy()
    emb.tables["t1"].weight = nn.Parameter(torch.zeros(30, 8, device="meta"))
    with pytest.raises(BuilderError) as raised:
        strategy.save_checkpoint(tmp_path / "moved", {"model": emb})
    message = str(raised.value)
    for part in ("'t1'", "moved from cpu to meta", "optimizer state are on cpu", ".to('cpu')"):
        assert part in message, part
    assert not (tmp_path / "moved").exists()


def test_a_disk_table_checkpoint_after_its_weight_was_replaced_is_refused(
    tmp_path: Path,
) -> None:
    """A disk table's weight is its row cache: a checkpoint saved after a replacement, before
    the next step, saved the old rows silently; it raises the error that step would raise."""
    with mp.empty_init():
        ebc = EmbeddingBagCollection([EmbeddingBagConfig("big", 64, 4)], seed=1)
    plan = EmbeddingPlan(1, {"big": row_wise(on_disk=True)})
    strategy = mp.ManualParallelStrategy()
    tier = DiskTier(tmp_path / "tier", cache_rows=12)
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.1), disk_tier=tier)
    features = SparseFeatures(("big",), torch.tensor([1, 5, 9]), torch.tensor([2, 1]))
    emb(features).values.sum().backward()
    strategy.save_checkpoint(tmp_path / "before", {"model": emb})  # the cache itself: saved
    emb.tables["big"].weight = nn.Parameter(torch.zeros(12, 4))
    with pytest.raises(BuilderError) as saved:
        strategy.save_checkpoint(tmp_path / "after", {"model": emb})
    with pytest.raises(BuilderError) as stepped:
        emb(features)
    assert str(saved.value) == str(stepped.value)
    assert "row cache (12 x 4 slots" in str(saved.value)
    assert not (tmp_path / "after").exists()
