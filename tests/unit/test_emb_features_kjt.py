"""SparseFeatures <-> TorchRec KeyedJaggedTensor, by duck typing (TorchRec is not a dependency).

The fakes below have exactly the methods `from_kjt` reads; a fake `torchrec` module checks what
`to_kjt` builds. The last tests use the real TorchRec and skip when it cannot be imported.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from typing import Any

import pytest
import torch

from manualpar.embeddings import EmbeddingBagCollection, EmbeddingBagConfig, SparseFeatures
from manualpar.errors import EmbeddingInputError, MissingDependencyError

BAGS = {"user": [[1, 2], [], [7]], "item": [[3], [4], [5, 6, 0]]}
WEIGHTS = {"user": [[0.5, 1.0], [], [2.0]], "item": [[1.5], [0.25], [1.0, 3.0, 0.5]]}


class FakeKJT:
    """keys(), values(), lengths() and weights_or_none(), as TorchRec's KeyedJaggedTensor."""

    def __init__(self, keys: list[str], values: Any, lengths: Any, weights: Any = None) -> None:
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Any:
        return self._values

    def lengths(self) -> Any:
        return self._lengths

    def weights_or_none(self) -> Any:
        return self._weights


class OffsetsOnlyKJT:
    """A jagged batch that knows only its offsets."""

    def __init__(self, keys: list[str], values: torch.Tensor, offsets: torch.Tensor) -> None:
        self._keys, self._values, self._offsets = keys, values, offsets

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def weights_or_none(self) -> None:
        return None


def _fake(batch: SparseFeatures) -> FakeKJT:
    return FakeKJT(list(batch.keys), batch.values, batch.lengths, batch.weights)


def _assert_same(got: SparseFeatures, expected: SparseFeatures) -> None:
    assert got.keys == expected.keys
    assert torch.equal(got.values, expected.values)
    assert torch.equal(got.lengths, expected.lengths)
    if expected.weights is None:
        assert got.weights is None
    else:
        assert got.weights is not None and torch.equal(got.weights, expected.weights)


def test_from_kjt_reads_a_kjt_like_object_and_shares_its_tensors() -> None:
    batch = SparseFeatures.from_dict(BAGS)
    got = SparseFeatures.from_kjt(_fake(batch))
    _assert_same(got, batch)
    assert got.values.data_ptr() == batch.values.data_ptr()  # no copy
    assert got["item"].to_lists() == BAGS["item"]


def test_from_kjt_keeps_weights_and_converts_int32() -> None:
    batch = SparseFeatures.from_dict(BAGS, WEIGHTS)
    fake = FakeKJT(["user", "item"], batch.values.int(), batch.lengths.int(), batch.weights)
    got = SparseFeatures.from_kjt(fake)
    _assert_same(got, batch)
    assert got.values.dtype == got.lengths.dtype == torch.int64
    assert got["user"].weights is not None
    assert got["user"].weights.tolist() == [0.5, 1.0, 2.0]


def test_from_kjt_takes_offsets_when_that_is_what_it_has() -> None:
    batch = SparseFeatures.from_dict(BAGS)
    _assert_same(
        SparseFeatures.from_kjt(OffsetsOnlyKJT(["user", "item"], batch.values, batch.offsets())),
        batch,
    )
    no_lengths = OffsetsOnlyKJT(["user", "item"], batch.values, batch.offsets())
    no_lengths.lengths = lambda: None  # type: ignore[attr-defined]  # lengths not computed yet
    _assert_same(SparseFeatures.from_kjt(no_lengths), batch)


def test_from_kjt_with_empty_features_and_no_features() -> None:
    empty = SparseFeatures.from_dict({"user": [[], [], []], "item": [[], [1], []]})
    got = SparseFeatures.from_kjt(_fake(empty))
    _assert_same(got, empty)
    assert got.batch_size == 3 and got.feature_sizes() == [0, 1]
    none = FakeKJT([], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    got = SparseFeatures.from_kjt(none)
    assert got.keys == () and got.batch_size == 0


def test_from_kjt_round_trip_feeds_a_collection_the_same_batch() -> None:
    tables = [EmbeddingBagConfig("user", 10, 4), EmbeddingBagConfig("item", 8, 3, pooling="mean")]
    ebc = EmbeddingBagCollection(tables, seed=3)
    batch = SparseFeatures.from_dict(BAGS, WEIGHTS)
    assert torch.equal(ebc(SparseFeatures.from_kjt(_fake(batch))).values, ebc(batch).values)


@pytest.mark.parametrize(
    ("obj", "missing"),
    [
        (object(), "keys(), values(), weights_or_none(), lengths() or offsets()"),
        ({"user": [[1]]}, "weights_or_none(), lengths() or offsets()"),  # a dict has keys()
        (SparseFeatures.from_dict(BAGS), "keys(), values(), weights_or_none()"),  # attributes
        (types.SimpleNamespace(keys=list, values=list, lengths=list), "weights_or_none()"),
        (
            types.SimpleNamespace(keys=list, values=list, weights_or_none=list),
            "lengths() or offsets()",
        ),
    ],
)
def test_from_kjt_names_what_an_object_lacks(obj: object, missing: str) -> None:
    name = type(obj).__name__
    message = (
        f"SparseFeatures.from_kjt(): a {name} has no {missing}; it takes a KeyedJaggedTensor or an "
        "object with keys(), values(), lengths() (or offsets()) and weights_or_none()"
    )
    with pytest.raises(EmbeddingInputError, match=f"^{re.escape(message)}$"):
        SparseFeatures.from_kjt(obj)


def test_from_kjt_refuses_bad_contents_as_any_batch() -> None:
    fake = FakeKJT(["user"], torch.tensor([1.0, 2.0]), torch.tensor([1, 1]))
    with pytest.raises(EmbeddingInputError, match=r"must hold integer ids \(int64 or int32\)"):
        SparseFeatures.from_kjt(fake)
    fake = FakeKJT(["user"], torch.tensor([1, 2, 3]), torch.tensor([1, 1]))
    with pytest.raises(EmbeddingInputError, match=r"lengths add up to 2 ids .* values holds 3"):
        SparseFeatures.from_kjt(fake)
    lazy = FakeKJT(["user"], torch.tensor([1]), None)
    with pytest.raises(EmbeddingInputError, match=r"lengths\(\) returned None and it has no"):
        SparseFeatures.from_kjt(lazy)


def test_from_kjt_names_what_a_variable_stride_lacks() -> None:
    fake = FakeKJT(["user", "item"], torch.tensor([1, 2]), torch.tensor([1, 0, 1]))
    fake.variable_stride_per_key = lambda: True  # type: ignore[attr-defined]
    with pytest.raises(
        EmbeddingInputError,
        match=r"a FakeKJT with a variable stride per key has no stride_per_key_per_rank\(\), "
        r"inverse_indices_or_none\(\)",
    ):
        SparseFeatures.from_kjt(fake)


class _RecordingKJT:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


def _fake_torchrec(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("torchrec", "torchrec.sparse", "torchrec.sparse.jagged_tensor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["torchrec.sparse.jagged_tensor"].KeyedJaggedTensor = _RecordingKJT  # type: ignore[attr-defined]


def test_to_kjt_builds_torchrecs_class_from_the_same_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_torchrec(monkeypatch)
    batch = SparseFeatures.from_dict(BAGS, WEIGHTS)
    kjt = batch.to_kjt()
    assert isinstance(kjt, _RecordingKJT)
    assert kjt.kwargs == {
        "keys": ["user", "item"],
        "values": batch.values,
        "lengths": batch.lengths,
        "weights": batch.weights,
        "stride": 3,
    }
    assert kjt.kwargs["values"] is batch.values


def test_to_kjt_without_torchrec_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchrec", None)  # as if not installed
    message = (
        "SparseFeatures.to_kjt() needs TorchRec, which is not installed (pip install torchrec; "
        "manualpar itself does not need it)"
    )
    with pytest.raises(MissingDependencyError, match=f"^{re.escape(message)}$"):
        SparseFeatures.from_dict(BAGS).to_kjt()


def test_to_kjt_with_a_broken_torchrec_shows_the_import_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'fbgemm_gpu'", name="fbgemm_gpu")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(
        ImportError, match=r"installed but failed to import: No module named 'fbgemm_gpu'$"
    ):
        SparseFeatures.from_dict(BAGS).to_kjt()


# with the real TorchRec -------------------------------------------------------------------------


def _jagged() -> Any:
    return pytest.importorskip(
        "torchrec.sparse.jagged_tensor",
        reason="TorchRec is not installed (make torchrec-peer builds an environment with it)",
    )


def test_round_trip_through_torchrecs_keyed_jagged_tensor() -> None:
    jagged = _jagged()
    batch = SparseFeatures.from_dict(BAGS, WEIGHTS)
    kjt = batch.to_kjt()
    assert isinstance(kjt, jagged.KeyedJaggedTensor)
    assert kjt.keys() == ["user", "item"] and kjt.stride() == 3
    assert kjt["item"].to_dense()[2].tolist() == [5, 6, 0]
    _assert_same(SparseFeatures.from_kjt(kjt), batch)
    empty = SparseFeatures.from_dict({"user": [[], []], "item": [[], [1]]})
    _assert_same(SparseFeatures.from_kjt(empty.to_kjt()), empty)
    built = jagged.KeyedJaggedTensor.from_offsets_sync(
        keys=["user", "item"], values=batch.values, offsets=batch.offsets()
    )
    _assert_same(SparseFeatures.from_kjt(built), SparseFeatures.from_dict(BAGS))
    variable = jagged.KeyedJaggedTensor(
        keys=["user", "item"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 0, 2]),
        stride_per_key_per_rank=[[2], [1]],
    )
    with pytest.raises(EmbeddingInputError, match=r"batch size per feature"):
        SparseFeatures.from_kjt(variable)


@pytest.mark.parametrize(("pooling", "weighted"), [("sum", True), ("mean", False)])
def test_torchrecs_collection_and_ours_pool_a_converted_batch_alike(
    pooling: str, weighted: bool
) -> None:
    """TorchRec's own (unsharded) collection on to_kjt()'s batch gives our pooled values
    (TorchRec's pure-torch module takes weights with sum pooling only)."""
    _jagged()
    from torchrec.modules.embedding_configs import EmbeddingBagConfig as TorchRecConfig
    from torchrec.modules.embedding_configs import PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecCollection

    tables = [
        EmbeddingBagConfig("user", 10, 4, pooling=pooling),
        EmbeddingBagConfig("item", 8, 3, pooling=pooling),
    ]
    ours = EmbeddingBagCollection(tables, seed=5)
    theirs = TorchRecCollection(
        tables=[
            TorchRecConfig(
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                name=t.name,
                feature_names=list(t.feature_names),
                pooling=PoolingType.SUM if pooling == "sum" else PoolingType.MEAN,
            )
            for t in tables
        ],
        is_weighted=weighted,
    )
    with torch.no_grad():
        for t in tables:
            theirs.embedding_bags[t.name].weight.copy_(ours.tables[t.name].weight)
    batch = SparseFeatures.from_dict(BAGS, WEIGHTS if weighted else None)
    expected = theirs(batch.to_kjt())
    got = ours(SparseFeatures.from_kjt(batch.to_kjt()))
    for key in ("user", "item"):
        torch.testing.assert_close(got[key], expected[key], msg=lambda m, k=key: f"{k}: {m}")
