"""A batch per feature (SparseFeatures.bags_per_key, inverse_indices): built, checked, expanded,
read from TorchRec's variable-stride KeyedJaggedTensor, and looked up by the unsharded
collection exactly as its expanded batch."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    SparseFeatures,
)
from manualpar.errors import EmbeddingInputError

# 4 samples: "user" deduplicated (samples 0, 1 read bag 0; samples 2, 3 bag 1), "item" plain
BAGS = {"user": [[1, 2], [7]], "item": [[3], [4], [5, 6], []]}
WEIGHTS = {"user": [[0.5, 1.0], [2.0]], "item": [[1.5], [0.25], [1.0, 3.0], []]}
INVERSE = {"user": [0, 0, 1, 1]}
EXPANDED = {"user": [[1, 2], [1, 2], [7], [7]], "item": [[3], [4], [5, 6], []]}


def test_a_variable_batch_expands_to_the_batch_it_stands_for() -> None:
    batch = SparseFeatures.from_dict(BAGS, WEIGHTS, INVERSE)
    assert batch.variable_batch and batch.batch_size == 4
    assert batch.bag_counts() == [2, 4] and batch.feature_sizes() == [3, 4]
    assert batch["user"].inverse_indices.tolist() == [0, 0, 1, 1]
    assert batch["item"].inverse_indices.tolist() == [0, 1, 2, 3]
    expanded = batch.expand()
    assert not expanded.variable_batch
    assert {k: expanded[k].to_lists() for k in expanded.keys} == EXPANDED
    assert expanded["user"].weights.tolist() == [0.5, 1.0, 0.5, 1.0, 2.0, 2.0]
    picked = batch.select(["item", "user"])
    assert picked.bag_counts() == [4, 2] and picked["user"].to_lists() == BAGS["user"]
    assert picked.inverse_indices.tolist() == [[0, 1, 2, 3], [0, 0, 1, 1]]
    again = SparseFeatures.from_features(batch.to_dict())
    assert again.bag_counts() == [2, 4] and torch.equal(
        again.inverse_indices, batch.inverse_indices
    )
    hashed = batch.with_values(batch.values + 10)
    assert hashed.bag_counts() == [2, 4] and hashed["user"].to_lists() == [[11, 12], [17]]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: SparseFeatures.from_dict(BAGS, inverse_indices={"user": [0, 2, 1, 1]}),
            r"feature 'user': inverse index 2 for sample 1 is outside \[0, 2\) \(the feature "
            r"has 2 bags\)",
        ),
        (
            lambda: SparseFeatures.from_dict(BAGS, inverse_indices={"item": [0, 1, 2, 3]}),
            r"features \{'user': 2\} \(bag counts\) have no inverse_indices, so they need one bag "
            r"per sample: 4 samples",
        ),
        (
            lambda: SparseFeatures(
                ("u",), torch.tensor([1]), torch.tensor([1, 0]), None, (3,), torch.tensor([[0]])
            ),
            r"lengths has 2 entries but bags_per_key \{'u': 3\} adds up to 3 bags",
        ),
        (
            lambda: SparseFeatures(("u",), torch.tensor([1]), torch.tensor([1]), None, (1,)),
            r"needs both bags_per_key .* and inverse_indices .* or neither",
        ),
        (
            lambda: SparseFeatures(
                ("u",), torch.tensor([1]), torch.tensor([1]), None, (1,), torch.tensor([0])
            ),
            r"inverse_indices must be a 2-D tensor \(features, batch\)",
        ),
    ],
)
def test_bad_bag_counts_and_inverse_indices_are_named(build: Any, message: str) -> None:
    with pytest.raises(EmbeddingInputError, match=message):
        build()


def test_a_bad_inverse_index_names_the_rank_in_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(EmbeddingInputError, match=r"has 2 bags\) on rank 3;"):
        SparseFeatures.from_dict(BAGS, inverse_indices={"user": [0, 0, 5, 1]})


class VariableKJT:
    """TorchRec's variable-stride KeyedJaggedTensor, as far as from_kjt reads it."""

    def __init__(self, inverse: Any) -> None:
        self.batch = SparseFeatures.from_dict(BAGS, WEIGHTS, INVERSE)
        self.inverse = inverse

    def keys(self) -> list[str]:
        return list(self.batch.keys)

    def values(self) -> torch.Tensor:
        return self.batch.values

    def lengths(self) -> torch.Tensor:
        return self.batch.lengths

    def weights_or_none(self) -> torch.Tensor | None:
        return self.batch.weights

    def variable_stride_per_key(self) -> bool:
        return True

    def stride_per_key_per_rank(self) -> list[list[int]]:
        return [[1, 1], [4]]  # "user": bags of two ranks' requests

    def inverse_indices_or_none(self) -> Any:
        return self.inverse


def test_from_kjt_reads_a_variable_stride_per_key() -> None:
    # keys in another order than the batch's; "item" (one bag per sample) may be left out
    for inverse in (
        (["item", "user"], torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]])),
        (["user"], torch.tensor([[0, 0, 1, 1]])),
    ):
        batch = SparseFeatures.from_kjt(VariableKJT(inverse))
        assert batch.bag_counts() == [2, 4]
        assert batch.inverse_indices.tolist() == [[0, 0, 1, 1], [0, 1, 2, 3]]
        assert {k: batch.expand()[k].to_lists() for k in batch.keys} == EXPANDED
    with pytest.raises(EmbeddingInputError, match=r"variable stride\) but no inverse_indices"):
        SparseFeatures.from_kjt(VariableKJT(None))


def test_to_kjt_gives_torchrec_the_variable_stride(monkeypatch: pytest.MonkeyPatch) -> None:
    class Recording:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs

    for name in ("torchrec", "torchrec.sparse", "torchrec.sparse.jagged_tensor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["torchrec.sparse.jagged_tensor"].KeyedJaggedTensor = Recording  # type: ignore[attr-defined]
    batch = SparseFeatures.from_dict(BAGS, None, INVERSE)
    kwargs = batch.to_kjt().kwargs
    assert kwargs["stride_per_key_per_rank"] == [[2], [4]] and kwargs["stride"] == 4
    assert kwargs["inverse_indices"][0] == ["user", "item"]
    assert kwargs["inverse_indices"][1] is batch.inverse_indices


TABLES = [
    EmbeddingBagConfig("user", 10, 4, pooling="mean"),
    EmbeddingBagConfig("item", 8, 3),
]


def test_the_collection_pools_each_bag_once_and_matches_the_expanded_batch() -> None:
    """Outputs bit for bit; gradients equal (float64); a bag no sample reads touches no row
    (a sparse rule such as Adam would step it)."""
    with_unread = SparseFeatures.from_dict(
        {"user": [[1, 2], [7], [9]], "item": BAGS["item"]}, None, INVERSE
    )
    expanded = with_unread.expand()
    grads = []
    for batch in (with_unread, expanded):
        ebc = EmbeddingBagCollection(TABLES, seed=3).double()
        out = ebc(batch).values
        (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append({n: t.weight.grad.to_dense() for n, t in ebc.tables.items()})
        grads[-1]["out"] = out.detach()
        touched = ebc.tables["user"].weight.grad.coalesce().indices()[0].tolist()
        assert 9 not in touched, touched  # row 9: only in the bag no sample reads
    assert torch.equal(grads[0]["out"], grads[1]["out"])
    for name in ("user", "item"):
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-15, atol=0)


def test_a_feature_expanded_alone_keeps_the_others_bags() -> None:
    batch = SparseFeatures.from_dict(BAGS, WEIGHTS, {"user": [0, 0, 1, 1], "item": [3, 2, 1, 0]})
    user = batch.expand(["user", "not a key"])
    assert user.variable_batch and user.bag_counts() == [4, 4]
    assert user.inverse_indices.tolist() == [[0, 1, 2, 3], [3, 2, 1, 0]]
    assert user["user"].to_lists() == EXPANDED["user"] and user["item"].to_lists() == BAGS["item"]
    assert user["user"].weights.tolist() == [0.5, 1.0, 0.5, 1.0, 2.0, 2.0]
    assert {k: user.expand()[k].to_lists() for k in batch.keys} == {
        k: batch.expand()[k].to_lists() for k in batch.keys
    }
    assert not batch.expand(["user", "item"]).variable_batch and batch.expand([]) is batch


def test_a_managed_table_remaps_a_batch_per_feature_as_its_expanded_batch() -> None:
    """A remap counts an id once per sample that reads it (a bucket's new ids take its free rows
    most-counted first): a deduplicated bag read by three samples counted once gave its ids
    other rows than the expanded batch. Outputs and remapper state equal over steps."""
    tables = [
        EmbeddingBagConfig("user", 8, 4, raw_ids=mp.ManagedCollisions(bucket_rows=8)),
        EmbeddingBagConfig("item", 8, 3, raw_ids=mp.ManagedCollisions(policy="lfu")),
    ]
    # "user": 6 read 3 times takes the first free row, before 5 read once (by one bag each,
    # the tie went to the smaller id)
    steps = [
        ({"user": [[5], [6]], "item": [[3], [4], [4], [3]]}, {"user": [0, 1, 1, 1]}),
        ({"user": [[9, 6], [8]], "item": [[3], [], [7], [3]]}, {"user": [1, 0, 1, 1]}),
    ]
    runs = []
    for expand in (False, True):
        ebc = EmbeddingBagCollection(tables, seed=3)
        outputs = []
        for bags, inverse in steps:
            batch = SparseFeatures.from_dict(bags, None, inverse)
            outputs.append(ebc(batch.expand() if expand else batch).values)
        runs.append((outputs, {k: v.clone() for k, v in ebc.raw_id_remap.state_dict().items()}))
    for step, (got, expected) in enumerate(zip(runs[0][0], runs[1][0], strict=True)):
        assert torch.equal(got, expected), step
    for key, value in runs[1][1].items():
        assert torch.equal(runs[0][1][key], value), key


def test_sequence_embeddings_refuse_a_batch_per_feature() -> None:
    ec = EmbeddingCollection([EmbeddingConfig("user", 10, 4), EmbeddingConfig("item", 8, 4)])
    with pytest.raises(
        EmbeddingInputError,
        match=r"features \['user'\] hold their own number of bags \(\{'user': 2, 'item': 4\} for "
        r"4 samples\), but sequence embeddings take one sequence per sample; pass "
        r"features.expand\(\)",
    ):
        ec(SparseFeatures.from_dict(BAGS, None, INVERSE))


def test_torchrecs_collection_and_ours_pool_a_variable_batch_alike() -> None:
    """TorchRec's unsharded collection on to_kjt()'s variable-stride batch: our pooled values."""
    pytest.importorskip("torchrec.sparse.jagged_tensor", reason="TorchRec is not installed")
    from torchrec.modules.embedding_configs import EmbeddingBagConfig as TorchRecConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecCollection

    tables = [EmbeddingBagConfig("user", 10, 4), EmbeddingBagConfig("item", 8, 3)]
    ours = EmbeddingBagCollection(tables, seed=5)
    theirs = TorchRecCollection(
        tables=[
            TorchRecConfig(
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                name=t.name,
                feature_names=list(t.feature_names),
            )
            for t in tables
        ]
    )
    with torch.no_grad():
        for t in tables:
            theirs.embedding_bags[t.name].weight.copy_(ours.tables[t.name].weight)
    batch = SparseFeatures.from_dict(BAGS, None, INVERSE)
    expected = theirs(batch.to_kjt())
    got = ours(SparseFeatures.from_kjt(batch.to_kjt()))
    for key in ("user", "item"):
        torch.testing.assert_close(got[key], expected[key], msg=lambda m, k=key: f"{k}: {m}")
