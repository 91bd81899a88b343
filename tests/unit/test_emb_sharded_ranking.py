"""top_k_items and target_ranks on one process, against q @ W.T and the tie rule written out
here (higher score first, then smaller id): unsharded collections, a float16 table, scoring in
chunks, a one-rank disk-tier table, a replaced weight, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranking_cases import int_queries, reference_order, tied_values

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    SparseFeatures,
    shard_embeddings,
    target_ranks,
    top_k_items,
)
from manualpar.errors import BuilderError, EmbeddingInputError, NonFiniteError

ROWS, DIM = 40, 6


def _tied_rows(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.copy_(tied_values(*weight.shape))


def _queries(batch: int, seed: int) -> torch.Tensor:
    return int_queries(batch, DIM, seed)


@pytest.mark.parametrize("kind", ["bags", "sequences", "float16"])
def test_unsharded_tables_rank_like_the_reference(kind: str) -> None:
    if kind == "sequences":
        emb = EmbeddingCollection([EmbeddingConfig("item", ROWS, DIM)])
    else:
        dtype = torch.float16 if kind == "float16" else torch.float32
        emb = EmbeddingBagCollection([EmbeddingBagConfig("item", ROWS, DIM, dtype=dtype)])
    weight = emb.tables["item"].weight
    _tied_rows(weight)
    queries = _queries(11, 0)
    queries[4] = 0  # every item ties: the ids in order
    order = reference_order(queries, weight.detach())
    for k in (1, 7, 16, 40):  # cuts through groups of tied items
        for chunk in (10, 1 << 22):  # chunks of 1 query x 10 rows, or one chunk
            scores, ids = top_k_items(emb, "item", queries, k, scores_per_chunk=chunk)
            assert ids.tolist() == [o[:k] for o in order], (k, chunk)
    assert ids[4].tolist() == list(range(40))
    full = queries @ weight.detach().float().T
    assert torch.equal(scores, full.gather(1, ids)) and scores.dtype == torch.float32
    targets = torch.tensor([0, 5, 35, 11, 1, 29, 12, 4, 2, 17, 38])  # duplicated rows too
    ranks = target_ranks(emb, "item", queries, targets, scores_per_chunk=7)
    assert ranks.tolist() == [o.index(t) + 1 for o, t in zip(order, targets.tolist(), strict=True)]
    assert ranks.dtype == torch.int64


def test_random_rows_and_the_default_chunks() -> None:
    emb = EmbeddingBagCollection([EmbeddingBagConfig("item", 300, 16)], seed=3)
    weight = emb.tables["item"].weight.detach()
    queries = torch.randn(20, 16, generator=torch.Generator().manual_seed(1))
    exact = (queries.double() @ weight.double().T).float()
    scores, ids = top_k_items(emb, "item", queries, 300)
    assert torch.equal(ids, exact.argsort(dim=1, descending=True, stable=True))
    assert torch.equal(scores, exact.gather(1, ids))
    targets = torch.arange(20) * 15
    expected = 1 + (exact > exact.gather(1, targets[:, None])).sum(dim=1)
    assert torch.equal(target_ranks(emb, "item", queries, targets), expected)
    none, none_ids = top_k_items(emb, "item", queries[:0], 5)
    assert none.shape == none_ids.shape == (0, 5)


def test_a_disk_tier_table_on_one_rank_ranks_like_the_unsharded_one(tmp_path: Path) -> None:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("item", ROWS, DIM)])
    _tied_rows(ebc.tables["item"].weight)
    order = reference_order(_queries(9, 2), ebc.tables["item"].weight.detach())
    tier = DiskTier(tmp_path, cache_rows=4)
    strategy = mp.ManualParallelStrategy()
    emb = shard_embeddings(
        ebc, strategy, {"item": mp.embeddings.row_wise(on_disk=True)}, SGD(lr=0.1), disk_tier=tier
    )
    _, ids = top_k_items(emb, "item", _queries(9, 2), 12, scores_per_chunk=9)
    assert ids.tolist() == [o[:12] for o in order]
    ranks = target_ranks(emb, "item", _queries(9, 2), torch.arange(9) * 4)
    assert ranks.tolist() == [o.index(4 * i) + 1 for i, o in enumerate(order)]


def test_bad_calls_name_the_table_and_the_fix() -> None:
    emb = EmbeddingBagCollection([EmbeddingBagConfig("item", ROWS, DIM)])
    queries = _queries(3, 0)
    with pytest.raises(EmbeddingInputError, match=r"no table 'user' .*its tables: \['item'\]"):
        top_k_items(emb, "user", queries, 5)
    with pytest.raises(EmbeddingInputError, match=r"k must be an int in \[1, 40\].*got 41"):
        top_k_items(emb, "item", queries, 41)
    with pytest.raises(EmbeddingInputError, match=r"floating \(batch, 6\) tensor .*\(3, 5\)"):
        top_k_items(emb, "item", queries[:, :5], 5)
    with pytest.raises(EmbeddingInputError, match=r"target 40 of query 1 is not a row"):
        target_ranks(emb, "item", queries, torch.tensor([0, 40, 1]))
    with mp.empty_init():
        meta = EmbeddingBagCollection([EmbeddingBagConfig("item", ROWS, DIM)])
    with pytest.raises(EmbeddingInputError, match="on the meta device"):
        top_k_items(meta, "item", queries, 5)


def test_nan_queries_and_rows_are_refused() -> None:
    """A diverged model's NaN queries (or NaN rows) once ranked every item by id; now refused,
    naming the table and what was NaN (tests/dist: on every rank alike)."""
    emb = EmbeddingBagCollection([EmbeddingBagConfig("item", ROWS, DIM)])
    queries = _queries(3, 0)
    queries[1, 2] = float("nan")
    queries[2, 0] = float("inf")
    bad_queries = (
        r"^{} on table 'item': queries hold 2 non-finite value\(s\) \(1 NaN, 1 inf\), the "
        r"first in query 1; a NaN or inf query has no order over the items \(a diverged model\?\): "
        r"check the model that made them$"
    )
    with pytest.raises(NonFiniteError, match=bad_queries.format("top_k_items")):
        top_k_items(emb, "item", queries, 5)
    with pytest.raises(NonFiniteError, match=bad_queries.format("target_ranks")):
        target_ranks(emb, "item", queries, torch.tensor([0, 1, 2]))
    with torch.no_grad():
        emb.tables["item"].weight[7] = float("nan")
    bad_rows = (
        r"^{} on table 'item': 3 of 120 scores are NaN; the queries are finite, so the "
        r"table's rows hold NaN or inf \(a diverged model\?\)\. "
        r"Check the table's rows \(mp.check_finite\) and train from an earlier checkpoint$"
    )
    with pytest.raises(NonFiniteError, match=bad_rows.format("top_k_items")):
        top_k_items(emb, "item", _queries(3, 0), 5)
    with pytest.raises(NonFiniteError, match=bad_rows.format("target_ranks")):
        target_ranks(emb, "item", _queries(3, 0), torch.tensor([0, 1, 2]))


def test_a_replaced_weight_is_ranked_as_the_next_step_takes_it(tmp_path: Path) -> None:
    """An in-memory block ranks the weight its table holds now (a replacement of the same shape
    and dtype, which the next step trains); a disk table's replaced weight (its row cache) ranked
    the old rows from its file silently: it now raises the error the next step would."""
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("item", ROWS, DIM)])
    strategy = mp.ManualParallelStrategy()
    emb = shard_embeddings(ebc, strategy, {"item": mp.embeddings.row_wise()}, SGD(lr=0.1))
    new = torch.zeros(ROWS, DIM)
    _tied_rows(new)
    emb.tables["item"].weight = torch.nn.Parameter(new)
    _, ids = top_k_items(emb, "item", _queries(5, 3), 8)
    assert ids.tolist() == [o[:8] for o in reference_order(_queries(5, 3), new)]

    ebc = EmbeddingBagCollection([EmbeddingBagConfig("item", ROWS, DIM)])
    tier = DiskTier(tmp_path, cache_rows=4)
    plan = {"item": mp.embeddings.row_wise(on_disk=True)}
    emb = shard_embeddings(ebc, strategy, plan, SGD(lr=0.1), disk_tier=tier)
    emb.tables["item"].weight = torch.nn.Parameter(torch.zeros(4, DIM))
    with pytest.raises(BuilderError) as stepped:
        emb(SparseFeatures(("item",), torch.tensor([1, 2]), torch.tensor([2])))
    for call in (
        lambda: top_k_items(emb, "item", _queries(3, 0), 5),
        lambda: target_ranks(emb, "item", _queries(3, 0), torch.tensor([0, 1, 2])),
    ):
        with pytest.raises(BuilderError) as ranked:
            call()
        assert str(ranked.value).endswith(f": rank 0: {stepped.value} (every rank stops)")
