"""A model with two sharded collections, on one process: the names its checkpoint entries and
metrics get (what docs/embeddings-tables.md promises), and how its pooled outputs are indexed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import manualpar as mp
from manualpar.checkpoint.extra import extra_checkpoint_entries
from manualpar.embeddings import (
    SGD,
    Adagrad,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    SparseFeatures,
    data_parallel,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.planning import plan_collections

USER = [EmbeddingBagConfig("user_id", 100, 8), EmbeddingBagConfig("user_geo", 10, 4)]
ITEM = [EmbeddingBagConfig("item_id", 100, 8), EmbeddingBagConfig("item_cat", 5, 4)]


class TwoTower(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.user = EmbeddingBagCollection(USER, seed=0)
        self.item = EmbeddingBagCollection(ITEM, seed=0)
        self.head = nn.Linear(8, 1)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        rules = {"user": RowWiseAdagrad(lr=0.1), "item": Adagrad(lr=0.1)}
        plans = plan_collections({"user": self.user, "item": self.item}, strategy, rule=rules)
        self.user = shard_embeddings(self.user, strategy, plans["user"], rules["user"])
        self.item = shard_embeddings(self.item, strategy, plans["item"], rules["item"])
        mp.materialize(self, strategy)

    def forward(self, batch: SparseFeatures) -> torch.Tensor:
        user = self.user(batch.select(["user_id", "user_geo"]))
        item = self.item(batch.select(["item_id", "item_cat"]))
        side = self.head(torch.cat([user["user_geo"], item["item_cat"]], 1)).squeeze(1)
        return (user["user_id"] * item["item_id"]).sum(1) + side

    def training_step(self, batch: SparseFeatures, step: int) -> torch.Tensor:
        return self(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.dense_parameters(), lr=0.1)


def _batch(step: int, strategy: mp.ManualParallelStrategy) -> SparseFeatures:
    return SparseFeatures.from_dict(
        {
            "item_id": [[4, 5], [6]],
            "user_id": [[1], [2]],
            "user_geo": [[3], []],
            "item_cat": [[1], [2]],
        }
    )


def test_pooled_outputs_index_by_feature() -> None:
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        model = TwoTower()
    model.setup(strategy)
    pooled = model.user(_batch(0, strategy).select(["user_id", "user_geo"]))
    assert pooled.values.shape == (2, 12) and pooled.keys == ("user_id", "user_geo")
    assert torch.equal(pooled["user_geo"], pooled.values[:, 8:12])
    assert torch.equal(pooled["user_geo"][1], torch.zeros(4))  # an empty bag pools to zeros
    assert list(pooled.to_dict()) == ["user_id", "user_geo"]
    reference = EmbeddingBagCollection(USER, seed=0)
    torch.testing.assert_close(
        pooled.values, reference(_batch(0, strategy).select(["user_id", "user_geo"])).values
    )


def test_checkpoint_and_metric_keys_of_two_collections(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        model = TwoTower()
    model.setup(strategy)
    assert list(model.state_dict()) == [
        "user.tables.user_id.weight",
        "user.tables.user_geo.weight",
        "item.tables.item_id.weight",
        "item.tables.item_cat.weight",
        "head.weight",
        "head.bias",
    ]
    dense = [
        name
        for name, p in model.named_parameters()
        if any(p is d for d in model.dense_parameters())
    ]
    assert dense == ["head.weight", "head.bias"]  # the sharded tables train themselves
    entries = extra_checkpoint_entries(model)
    assert list(entries) == ["sparse_optim_user", "sparse_optim_item"]
    assert entries["sparse_optim_user"] is model.user.fused_optimizer
    assert list(entries["sparse_optim_item"].state_dict()["state"]) == ["item_id", "item_cat"]
    trainer = mp.Trainer(strategy, tmp_path, max_steps=2, log_every=1, progress=False)
    trainer.fit(model, _batch)
    records = [json.loads(line) for line in trainer.metrics_path.read_text().splitlines()]
    assert list(records[-1]) == [
        "step",
        "loss",
        "lr",
        "sparse_optim_user/lr",
        "sparse_optim_item/lr",
        "steps_per_s",
    ]


def test_dense_parameters_leave_out_sharded_tables_replicated_ones_too() -> None:
    """Every table of a sharded collection, data-parallel ones included, is updated by its fused
    optimizer; a collection left unsharded is ordinary parameters (sparse gradients)."""

    class Model(mp.ParallelModule):
        def __init__(self) -> None:
            super().__init__()
            self.sharded = EmbeddingBagCollection(USER)
            self.plain = EmbeddingBagCollection(ITEM)
            self.head = nn.Linear(8, 1)

        def setup(self, strategy: mp.ManualParallelStrategy) -> None:
            plan = {"user_id": table_wise(0), "user_geo": data_parallel()}
            self.sharded = shard_embeddings(self.sharded, strategy, plan, SGD(lr=0.1))
            mp.materialize(self, strategy)

    model = Model()
    model.setup(mp.ManualParallelStrategy())
    expected = [
        "plain.tables.item_id.weight",
        "plain.tables.item_cat.weight",
        "head.weight",
        "head.bias",
    ]
    dense = {id(p) for p in model.dense_parameters()}
    assert [n for n, p in model.named_parameters() if id(p) in dense] == expected
    # a sharded table's weight replaced before any step is still its fused optimizer's (it was
    # handed to the dense optimizer: updated twice once the step took it)
    table = model.sharded.tables["user_id"]
    table.weight = nn.Parameter(table.weight.detach().clone())
    dense = {id(p) for p in model.dense_parameters()}
    assert [n for n, p in model.named_parameters() if id(p) in dense] == expected
