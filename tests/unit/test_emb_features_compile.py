"""SparseFeatures and the sharded lookup inside torch.compile, on one process.

A batch built inside a compiled function is validated eagerly (the checks read values back to
the host), with the same numbers and the same errors as without compile.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from embedding_cases import SEED, TABLES, make_batch, mixed_plan, optimizer
from torch._dynamo.testing import CompileCounterWithBackend

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    ShardedEmbeddingBagCollection,
    SparseFeatures,
    shard_embeddings,
)
from manualpar.errors import EmbeddingInputError


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _sharded() -> ShardedEmbeddingBagCollection:
    strategy = mp.ManualParallelStrategy()
    ebc = EmbeddingBagCollection(TABLES, seed=SEED)
    return shard_embeddings(ebc, strategy, mixed_plan(1), optimizer("sgd"))


def test_batch_built_inside_compiled_function_matches_eager_and_is_validated() -> None:
    emb = _sharded()

    def lookup(keys: tuple[str, ...], raw: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        features = SparseFeatures(keys, raw % 9, lengths)  # ids hashed inside the graph
        return emb(features).values * 2

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lookup, backend=counter)
    with torch.no_grad():
        for step, size in enumerate((4, 4, 7)):
            batch = make_batch(0, step, size)
            expected = lookup(batch.keys, batch.values + 1000, batch.lengths)
            got = compiled(batch.keys, batch.values + 1000, batch.lengths)
            assert torch.equal(got, expected), f"step {step}"
        ops = [getattr(n.target, "__name__", "") for g in counter.graphs for n in g.graph.nodes]
        assert "mod" in ops and "mul" in ops, ops  # the code around the lookup compiled
        lengths = batch.lengths.clone()
        lengths[size + 1] = -1  # the second feature's second bag
        with pytest.raises(EmbeddingInputError, match=r"negative bag length -1 for sample 1;"):
            compiled(batch.keys, batch.values, lengths)


def test_out_of_range_id_in_compiled_model_is_the_eager_error() -> None:
    emb = _sharded()
    compiled = torch.compile(lambda features: emb(features).values, backend="aot_eager")
    bad = SparseFeatures.from_dict({f: [[1], [2]] for f in emb.feature_names} | {"t0": [[3], [50]]})
    with pytest.raises(EmbeddingInputError) as eager:
        emb(bad)
    with pytest.raises(EmbeddingInputError) as under_compile:
        compiled(bad)
    assert str(under_compile.value) == str(eager.value)
    assert "id 50 at position 1" in str(eager.value) and "out of range" in str(eager.value)


def test_select_and_getitem_compile_without_graph_breaks() -> None:
    """Slicing a validated batch reads no value back to the host: fullgraph=True would raise
    at the first graph break (a `.item()`, or re-validating the selected batch)."""

    def pick(batch: SparseFeatures) -> tuple[torch.Tensor, ...]:
        chosen = batch.select(["c", "a"])
        assert chosen.weights is not None
        return batch["b"].values * 2, chosen.values + 1, chosen.lengths, chosen.weights

    compiled = torch.compile(pick, fullgraph=True, backend="eager")
    for bags in ([[1, 2], [3]], [[1], [2, 3, 4], [5]]):  # a new batch size and new id counts
        dense = {"a": bags, "b": [[9]] + [[]] * (len(bags) - 1), "c": bags[::-1]}
        batch = SparseFeatures.from_dict(dense)
        batch = SparseFeatures(batch.keys, batch.values, batch.lengths, batch.values * 0.5)
        for got, expected in zip(compiled(batch), pick(batch), strict=True):
            assert torch.equal(got, expected)
        assert batch.select(["c", "a"]).feature_sizes() == [
            batch.feature_sizes()[2],
            batch.feature_sizes()[0],
        ]
