"""EmbeddingCollection (one row per id) on one process: rows, jagged structure, empty bags,
errors, and the sharded module on world size 1 against torch's optimizers.

The multi-rank runs against the same reference are in tests/dist/test_emb_sharded_sequence_ranks.py.
"""

from __future__ import annotations

import pytest
import torch
from embedding_cases import OPTIMIZERS, SEED, STEPS, assert_close, optimizer
from sequence_cases import TABLES, local_loss, make_batch, reference
from tiny_tables import raises as _raises
from tiny_tables import tiny_tables

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedEmbeddings,
    SequenceEmbeddings,
    ShardedEmbeddingCollection,
    SparseFeatures,
    shard_embeddings,
    table_wise,
)
from manualpar.errors import BuilderError, EmbeddingInputError

SMALL = tiny_tables(EmbeddingConfig, item_dim=3)
BATCH = {"user": [[1, 1, 7], [], [2]], "item": [[0], [4, 3], []], "last_item": [[], [], []]}


def test_rows_are_the_table_rows_of_each_id_in_batch_order() -> None:
    ec = EmbeddingCollection(SMALL, seed=3)
    # keys in another order than the tables': the output follows the tables
    out = ec(SparseFeatures.from_dict({k: BATCH[k] for k in ("last_item", "item", "user")}))
    assert isinstance(out, SequenceEmbeddings)
    assert out.keys == ("user", "item", "last_item")
    weights = {"user": ec.tables["user"].weight, "item": ec.tables["item"].weight}
    for feature, table in (("user", "user"), ("item", "item"), ("last_item", "item")):
        ids = [i for bag in BATCH[feature] for i in bag]
        got = out[feature]
        assert torch.equal(got.values, weights[table][torch.tensor(ids, dtype=torch.long)])
        assert got.lengths.tolist() == [len(bag) for bag in BATCH[feature]]
    assert out["user"].offsets().tolist() == [0, 3, 3, 4]
    assert [s.shape[0] for s in out["item"].split()] == [1, 2, 0]
    assert out["last_item"].values.shape == (0, 3)
    assert set(out.to_dict()) == {"user", "item", "last_item"}


def test_initial_rows_equal_the_bag_collection_tables_of_the_same_name() -> None:
    ec = EmbeddingCollection(SMALL, seed=5)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("user", 10, 4)], seed=5)
    assert torch.equal(ec.tables["user"].weight, ebc.tables["user"].weight)


def test_a_batch_of_no_samples_gives_empty_rows_per_feature() -> None:
    out = EmbeddingCollection(SMALL)(SparseFeatures.from_dict({k: [] for k in BATCH}))
    assert out["user"].values.shape == (0, 4) and out["user"].lengths.numel() == 0
    padded, mask = out["item"].to_padded()
    assert padded.shape == (0, 0, 3) and mask.shape == (0, 0)


def test_to_padded_places_each_sample_rows_and_masks_the_rest() -> None:
    values = torch.arange(12.0).view(6, 2).requires_grad_()
    jagged = JaggedEmbeddings(values, torch.tensor([2, 0, 3, 1]))
    padded, mask = jagged.to_padded()
    expected = torch.zeros(4, 3, 2)
    expected[0, :2], expected[2, :3], expected[3, :1] = values[0:2], values[2:5], values[5:6]
    assert torch.equal(padded, expected)
    assert mask.tolist() == [
        [True, True, False],
        [False, False, False],
        [True, True, True],
        [True, False, False],
    ]
    padded.sum().backward()
    assert torch.equal(values.grad, torch.ones(6, 2))
    short, short_mask = jagged.to_padded(2)  # the third sample keeps its first 2 ids
    assert torch.equal(short[2], values[2:4].detach()) and short_mask[2].tolist() == [True, True]
    assert jagged.to_padded(5)[0].shape == (4, 5, 2)
    with _raises(EmbeddingInputError, "to_padded: length must be >= 0, got -1"):
        jagged.to_padded(-1)


def test_sharded_on_one_process_matches_torch_for_every_optimizer() -> None:
    strategy = mp.ManualParallelStrategy()
    for normalize in ("world_size", "global_samples"):
        for opt_name in OPTIMIZERS:
            with mp.empty_init():
                ec = EmbeddingCollection(TABLES, seed=SEED)
            emb = shard_embeddings(
                ec, strategy, "auto", optimizer(opt_name), normalize_by=normalize
            )
            assert isinstance(emb, ShardedEmbeddingCollection)
            first: dict[str, torch.Tensor] = {}
            for step in range(STEPS):
                out = emb(make_batch(0, step, 4))
                if step == 0:
                    first = {k: v.values.detach().clone() for k, v in out.to_dict().items()}
                local_loss(out, 0, step, 4).backward()
            ref_first, ref_tables, ref_state = reference(opt_name, [4], normalize)
            where = f"{opt_name}, {normalize}"
            for feature, rows in ref_first[0].items():
                assert_close(first[feature], rows, f"{where}: step-0 rows of {feature}")
            with full_tensors():
                weights = emb.state_dict()
                state = emb.fused_optimizer.state_dict()["state"]
            for name, expected in ref_tables.items():
                assert_close(weights[f"tables.{name}.weight"], expected, f"{where}: {name}")
                for key, value in ref_state[name].items():
                    assert_close(state[name][key], value, f"{where}: state {name}/{key}")


def test_sharded_output_has_the_jagged_structure_of_the_batch() -> None:
    strategy = mp.ManualParallelStrategy()
    plan = {"user": table_wise(0), "item": table_wise(0)}
    emb = shard_embeddings(EmbeddingCollection(SMALL, seed=3), strategy, plan, SGD(lr=0.1))
    reference_ec = EmbeddingCollection(SMALL, seed=3)
    batch = SparseFeatures.from_dict(BATCH)
    out, expected = emb(batch), reference_ec(batch)
    for feature in BATCH:
        assert torch.equal(out[feature].values, expected[feature].values), feature
        assert torch.equal(out[feature].lengths, expected[feature].lengths), feature
    # one row per id even when a feature has no ids at all, or the batch no samples
    empty = emb(SparseFeatures.from_dict({k: [] for k in BATCH}))
    assert [empty[k].values.shape for k in BATCH] == [(0, 4), (0, 3), (0, 3)]


def test_a_prefetched_batch_keyed_in_another_order_keeps_its_jagged_structure() -> None:
    strategy = mp.ManualParallelStrategy()
    plan = {"user": table_wise(0), "item": table_wise(0)}
    emb = shard_embeddings(EmbeddingCollection(SMALL, seed=3), strategy, plan, SGD(lr=0.1))
    expected = EmbeddingCollection(SMALL, seed=3)(SparseFeatures.from_dict(BATCH))
    batch = SparseFeatures.from_dict({k: BATCH[k] for k in ("last_item", "item", "user")})
    emb.prefetch(batch)
    with torch.no_grad():
        out = emb(batch)
    for feature in BATCH:  # each feature's own lengths, not those of the key in its place
        assert torch.equal(out[feature].lengths, expected[feature].lengths), feature
        assert torch.equal(out[feature].values, expected[feature].values), feature


# ---- errors ----------------------------------------------------------------------------------
def test_weighted_ids_are_refused_naming_the_features() -> None:
    weights = {k: [[0.5] * len(bag) for bag in bags] for k, bags in BATCH.items()}
    batch = SparseFeatures.from_dict(BATCH, weights)
    message = ("features ['user', 'item', 'last_item'] carry per-id weights", "drop the weights")
    with _raises(EmbeddingInputError, *message):
        EmbeddingCollection(SMALL)(batch)
    emb = shard_embeddings(
        EmbeddingCollection(SMALL), mp.ManualParallelStrategy(), "auto", SGD(lr=0.1)
    )
    with _raises(EmbeddingInputError, *message):
        emb(batch)


def test_bad_ids_and_features_name_the_feature_and_table() -> None:
    ec = EmbeddingCollection(SMALL)
    bad = SparseFeatures.from_dict({**BATCH, "last_item": [[], [5], []]})
    with _raises(
        EmbeddingInputError,
        "feature 'last_item' (table 'item', 5 rows): id 5 at position 0",
        "(sample 1) is out of range; ids must be in [0, 5)",
    ):
        ec(bad)
    with _raises(EmbeddingInputError, "features ['last_item'] are missing from the batch"):
        ec(SparseFeatures.from_dict({k: BATCH[k] for k in ("user", "item")}))
    with _raises(EmbeddingInputError, "no feature 'history' in these embeddings", "'user'"):
        ec(SparseFeatures.from_dict(BATCH))["history"]


def test_bag_configs_are_refused_by_the_sequence_collection() -> None:
    with _raises(
        EmbeddingInputError,
        "EmbeddingCollection takes EmbeddingConfig tables (one row per id, no pooling), got "
        "EmbeddingBagConfig 'user'",
    ):
        EmbeddingCollection([EmbeddingBagConfig("user", 10, 4, pooling="mean")])
    with pytest.raises(TypeError):
        EmbeddingConfig("user", 10, 4, pooling="mean")  # type: ignore[call-arg]
    with _raises(EmbeddingInputError, "table 'user': embedding_dim must be a positive int"):
        EmbeddingConfig("user", 10, 0)


def test_shard_embeddings_names_both_collection_types() -> None:
    with _raises(
        BuilderError,
        "shard_embeddings() takes an EmbeddingBagCollection or an EmbeddingCollection, got Linear",
    ):
        shard_embeddings(
            torch.nn.Linear(2, 2),  # type: ignore[arg-type]
            mp.ManualParallelStrategy(),
            "auto",
            SGD(lr=0.1),
        )
