"""A table's weight replaced by one of the same shape and dtype (a new Parameter, or new data
under the same one) is what a checkpoint saves and what a load writes, not the block the
collection was built with."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    SparseFeatures,
    shard_embeddings,
)
from manualpar.ownership import owner_of, trained_by_owner


def _sharded() -> ShardedEmbeddingBagCollection:
    configs = [EmbeddingBagConfig(f"t{i}", 20, 4, feature_names=(f"f{i}",)) for i in range(2)]
    ebc = EmbeddingBagCollection(configs, seed=3)
    emb = shard_embeddings(ebc, mp.ManualParallelStrategy(), "auto", RowWiseAdagrad(lr=0.1))
    assert isinstance(emb, ShardedEmbeddingBagCollection)
    return emb


def _step(emb: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 20, (6,), generator=g)
    features = SparseFeatures(("f0", "f1"), values, torch.tensor([1, 2, 0, 1, 1, 1]))
    emb(features).values.sum().backward()


@pytest.mark.parametrize("how", ["parameter", "data"])
def test_a_checkpoint_saves_and_loads_the_replaced_weight(how: str, tmp_path) -> None:
    strategy = mp.ManualParallelStrategy()
    emb = _sharded()
    _step(emb, 0)
    for table in emb.tables.values():
        new = torch.linspace(-1, 1, table.weight.numel()).view_as(table.weight)
        if how == "parameter":
            table.weight = nn.Parameter(new)
        else:
            table.weight.data = new
    saved = {name: table.weight.detach().clone() for name, table in emb.tables.items()}
    state = {"model": emb, "sparse_optim": emb.fused_optimizer}
    strategy.save_checkpoint(tmp_path / "ckpt", state)

    fresh = _sharded()
    strategy.load_checkpoint(
        tmp_path / "ckpt", {"model": fresh, "sparse_optim": fresh.fused_optimizer}
    )
    for name, weight in saved.items():
        assert torch.equal(fresh.tables[name].weight, weight), f"{name}: saved the old block"

    _step(emb, 1)  # the replaced weights train on
    strategy.load_checkpoint(tmp_path / "ckpt", state)
    for name, weight in saved.items():
        assert torch.equal(emb.tables[name].weight, weight), f"{name}: loaded into the old block"


def test_the_param_group_holds_the_replaced_weights_from_the_next_step_on() -> None:
    """torch's view of the fused optimizer (its param group, its state by parameter) follows a
    replaced weight, which keeps the owner marks (`dense_parameters()` leaves it out), and no
    longer keeps the old block alive."""
    emb = _sharded()
    optimizer = emb.fused_optimizer
    old = weakref.ref(emb.tables["t0"].weight)
    emb.tables["t0"].weight = nn.Parameter(torch.zeros(20, 4))
    _step(emb, 0)
    current = [table.weight for table in emb.tables.values()]
    assert all(p is w for p, w in zip(optimizer.param_groups[0]["params"], current, strict=True))
    assert optimizer.state[current[0]] is optimizer.table_state["t0"]
    assert len(optimizer.state) == 2
    assert trained_by_owner(current[0]), "a dense optimizer would take the new weight"
    assert owner_of(current[0]) == "shard_embeddings"
    gc.collect()
    assert old() is None, "the optimizer kept the replaced block alive"


def test_a_checkpoint_refuses_a_weight_replaced_by_another_shape(tmp_path) -> None:
    """Saved before the step that would stop on it, a 10-row weight in a 20-row block would
    write half the table and leave the rest to whatever the loading model holds."""
    emb = _sharded()
    emb.tables["t0"].weight = nn.Parameter(torch.zeros(10, 4))
    with pytest.raises(mp.errors.BuilderError) as raised:
        mp.ManualParallelStrategy().save_checkpoint(tmp_path / "ckpt", {"model": emb})
    for part in ("'t0'", "10 x 4 torch.float32", "20 x 4 torch.float32", "copy_"):
        assert part in str(raised.value), part


def test_the_param_group_follows_a_replaced_weight_before_the_next_step() -> None:
    """Read between the replacement and the next step (a scheduler, a save, a user), torch's view
    showed the old Parameter; it holds what the table holds as soon as it is read, with the
    owner marks."""
    emb = _sharded()
    optimizer = emb.fused_optimizer
    new = emb.tables["t1"].weight = nn.Parameter(torch.zeros(20, 4))
    assert optimizer.param_groups[0]["params"][1] is new
    assert optimizer.state[new] is optimizer.table_state["t1"] and len(optimizer.state) == 2
    assert trained_by_owner(new) and owner_of(new) == "shard_embeddings"
    newer = emb.tables["t0"].weight = nn.Parameter(torch.ones(20, 4))
    assert optimizer.state[newer] is optimizer.table_state["t0"]  # the state follows alone too
    _step(emb, 0)  # the step takes them as the view does
    assert all(
        p is w for p, w in zip(optimizer.param_groups[0]["params"], (newer, new), strict=True)
    )
