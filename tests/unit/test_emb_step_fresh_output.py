"""A sharded step's pooled output where every column is written once (table-wise, column-wise,
replicated tables): the rows copied into an unfilled output, not added into zeros, with the
same bits, -0.0 included (ExchangeLayout.fills_output); row splits, compact layouts and a
narrower wire keep the zero fill and the add."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    column_wise,
    data_parallel,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.kernels.bags import pooled_sum
from manualpar.embeddings.step.exchange import ExchangeLayout
from manualpar.embeddings.step.routing import Routing

CONFIGS = [
    EmbeddingBagConfig("a", 6, 4),
    EmbeddingBagConfig("b", 6, 8),
    EmbeddingBagConfig("c", 6, 4),
]


def _is_negative_zero(values: torch.Tensor) -> torch.Tensor:
    return (values == 0) & torch.signbit(values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_pooled_sum_is_never_negative_zero(dtype: torch.dtype) -> None:
    """What the copy relies on: 0 + x has x's bits for every x but -0.0, and no pooled sum is
    -0.0 (a row of -0.0 alone, or -1 times a +0.0 row, pools to +0.0)."""
    weight = torch.full((3, 16), -0.0, dtype=dtype)
    weight[2] = 0.0
    ids = torch.tensor([0, 1, 0, 2, 2])
    lengths = torch.tensor([1, 2, 0, 1, 1])
    for weights in (None, torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])):
        pooled = pooled_sum(weight, ids, lengths, weights)
        assert pooled.shape == (5, 16)
        assert not bool(_is_negative_zero(pooled).any())


def _layout(plan: dict[str, object], rank: int = 0) -> ExchangeLayout:
    return ExchangeLayout(Routing(CONFIGS, EmbeddingPlan(2, plan), rank))  # type: ignore[arg-type]


def test_only_columns_written_once_leave_the_output_unfilled() -> None:
    once = _layout({"a": table_wise(1), "b": column_wise([0, 1]), "c": data_parallel()})
    assert once.writes_once
    assert once.fills_output(None, torch.float32)
    assert not once.fills_output(None, torch.bfloat16)  # may round a tiny sum to -0.0
    assert not once.fills_output([None, [torch.tensor([0])]], torch.float32)  # some rows only
    split = _layout({"a": table_wise(1), "b": row_wise(), "c": table_wise(0)})
    assert not split.writes_once  # the owners' partial sums add up
    assert not split.fills_output(None, torch.float32)


@pytest.mark.parametrize("batched", [False, True])
def test_one_process_output_is_copied_with_the_reference_bits(
    monkeypatch: pytest.MonkeyPatch, batched: bool
) -> None:
    """Rows of -0.0 pool to +0.0 in the output, as in the unsharded lookup, and the output is
    not a zero-filled tensor the rows are added into: per table (SGD) and in the table batch
    (row-wise Adagrad), which adds into its own columns zeroed alone."""
    strategy = mp.ManualParallelStrategy()
    ebc = EmbeddingBagCollection(CONFIGS, seed=0)
    with torch.no_grad():
        ebc.tables["a"].weight[:3] = -0.0
    weights = {name: table.weight.detach().clone() for name, table in ebc.tables.items()}
    plan = {"a": table_wise(0), "b": table_wise(0), "c": data_parallel()}
    rule = RowWiseAdagrad(lr=0.1) if batched else SGD(lr=0.1)
    emb = shard_embeddings(ebc, strategy, plan, rule)
    bags = {"a": [[0], [1, 2], [], [4]], "b": [[1], [2], [3], []], "c": [[5], [], [0, 1], [2]]}
    features = SparseFeatures.from_dict(bags)
    zeros = torch.zeros
    filled: list[tuple[int, ...]] = []

    def counted(*size: object, **kwargs: object) -> torch.Tensor:
        filled.append(tuple(size))  # type: ignore[arg-type]
        return zeros(*size, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(torch, "zeros", counted)
    with torch.no_grad():
        out = emb(features).values
    monkeypatch.setattr(torch, "zeros", zeros)
    assert (4, 16) not in filled
    expected = []
    for name in ("a", "b", "c"):
        offsets, ids = [0], []
        for bag in bags[name]:
            ids += bag
            offsets.append(offsets[-1] + len(bag))
        expected.append(
            F.embedding_bag(
                torch.tensor(ids), weights[name], torch.tensor(offsets[:-1]), mode="sum"
            )
        )
    reference = torch.cat(expected, 1)
    assert torch.equal(out, reference)
    assert torch.equal(_is_negative_zero(out), _is_negative_zero(reference))
    assert not bool(_is_negative_zero(out).any())
