"""top_k_items and target_ranks on 1, 2 and 3 ranks (and a 2 x 2 mesh), each rank with its own
number of queries (one with none), equal to the unsharded collection holding the same full
tables: row-wise, table-wise, table-row-wise and data-parallel tables whose scores tie
(duplicate rows), a rank with fewer rows than k, scoring in small chunks. A bad call on one
rank stops every rank; a column-wise table is refused; a NaN query on one rank, NaN scores
from the rows of one rank, or a block replaced on one rank, are refused on every rank alike."""

from __future__ import annotations

import pytest
import torch
from ranking_cases import int_queries, reference_order, tied_values

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    column_wise,
    data_parallel,
    row_wise,
    shard_embeddings,
    table_row_wise,
    table_wise,
    target_ranks,
    top_k_items,
)
from manualpar.errors import BuilderError, EmbeddingInputError, NonFiniteError, PlanError
from manualpar.testing import run_distributed

ROWS, DIM, K = 23, 4, 10  # 3 row-wise ranks hold 8, 8 and 7 rows: fewer than K
TABLES = ("rows", "one", "node", "copies")
BATCHES = {1: [5], 2: [4, 0], 3: [0, 6, 3], 4: [3, 0, 2, 4]}
NAN_QUERY_RANK = {2: 0, 3: 1}  # a rank with queries
NAN_ROW = 20  # row-wise: held by the last rank


def _collection(world: int) -> EmbeddingBagCollection:
    names = TABLES + (("cols", "nans") if world > 1 else ())
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(n, ROWS, DIM) for n in names])
    with torch.no_grad():
        for seed, name in enumerate(names):
            ebc.tables[name].weight.copy_(tied_values(ROWS, DIM, seed))
        if world > 1:
            ebc.tables["nans"].weight[NAN_ROW, 1] = float("nan")
    return ebc


def _inputs(world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch = BATCHES[world][rank]
    targets = torch.randint(0, ROWS, (batch,), generator=torch.Generator().manual_seed(rank))
    return int_queries(batch, DIM, seed=10 + rank), targets


def _rank(world: int) -> dict:
    strategy = mp.ManualParallelStrategy()
    plan = {
        "rows": row_wise(),
        "one": table_wise(world - 1),
        "node": table_row_wise(node=0, ranks_per_node=min(2, world)),
        "copies": data_parallel(),
    }
    if world > 1:
        plan["cols"] = column_wise(ranks=(0, 1))
        plan["nans"] = row_wise()
    emb = shard_embeddings(_collection(world), strategy, plan, SGD(lr=0.1))
    queries, targets = _inputs(world, strategy.rank)
    found = {}
    for name in TABLES:
        scores, ids = top_k_items(emb, name, queries, K, scores_per_chunk=16)
        ranks = target_ranks(emb, name, queries, targets, scores_per_chunk=16)
        found[name] = (scores, ids, ranks)
    errors = []
    if world > 1:
        bad = queries[:, :3] if strategy.rank == 1 else queries
        nan = queries.clone()
        if strategy.rank == NAN_QUERY_RANK[world]:
            nan[0, 2] = float("nan")
        for call in (
            lambda: top_k_items(emb, "rows", bad, K),
            lambda: target_ranks(emb, "one", bad, targets),
            lambda: top_k_items(emb, "rows", queries, 2 + strategy.rank),
            lambda: top_k_items(emb, "cols", queries, K),
            lambda: top_k_items(emb, "rows", nan, K),
            lambda: target_ranks(emb, "one", nan, targets),
            lambda: top_k_items(emb, "nans", queries, K, scores_per_chunk=16),
            lambda: target_ranks(emb, "nans", queries, targets, scores_per_chunk=16),
        ):
            try:
                call()
            except (EmbeddingInputError, PlanError, NonFiniteError) as error:
                errors.append(f"{type(error).__name__}: {error}")
        found["after"] = top_k_items(emb, "rows", queries, 3)  # the ranks still agree
        errors.append(_replaced_on_one_rank(emb, strategy.rank, queries))
    strategy.teardown()
    return {"found": found, "errors": errors}


def _replaced_on_one_rank(emb: torch.nn.Module, rank: int, queries: torch.Tensor) -> str:
    """Rank 1's block replaced by one of another shape: that rank refused to rank it alone,
    and the others waited in the ranking's collectives until their timeout."""
    table = emb.tables["rows"]
    held = table.weight
    if rank == 1:
        table.weight = torch.nn.Parameter(torch.zeros(3, DIM))
    try:
        top_k_items(emb, "rows", queries, K)
    except BuilderError as error:
        return f"BuilderError: {error}"
    finally:
        table.weight = held
    return "ranked"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_ranking_equals_the_unsharded_tables(world: int) -> None:
    results = run_distributed(_rank, world, args=(world,), timeout=60, collective_timeout=20)
    full = _collection(world)
    for rank, result in enumerate(results):
        queries, targets = _inputs(world, rank)
        for name in TABLES:
            scores, ids, ranks = result["found"][name]
            weight = full.tables[name].weight.detach()
            order = reference_order(queries, weight)
            assert ids.tolist() == [o[:K] for o in order], (name, rank)
            assert torch.equal(scores, (queries @ weight.T).gather(1, ids)), (name, rank)
            expected = [o.index(t) + 1 for o, t in zip(order, targets.tolist(), strict=True)]
            assert ranks.tolist() == expected, (name, rank)
            assert ranks.dtype == ids.dtype == torch.int64 and scores.shape == (len(queries), K)
            unsharded = top_k_items(full, name, queries, K)
            assert torch.equal(unsharded[1], ids)
        if world > 1:
            assert result["errors"] == [
                "EmbeddingInputError: top_k_items on table 'rows': rank 1: queries must be a "
                f"floating (batch, 4) tensor for table 'rows', got ({BATCHES[world][1]}, 3) "
                "torch.float32 "
                "(every rank stops)",
                "EmbeddingInputError: target_ranks on table 'one': rank 1: queries must be a "
                f"floating (batch, 4) tensor for table 'one', got ({BATCHES[world][1]}, 3) "
                "torch.float32 "
                "(every rank stops)",
                "EmbeddingInputError: top_k_items on table 'rows': ranks passed different k: "
                f"{[2 + r for r in range(world)]} (every rank stops)",
                "PlanError: top_k_items: table 'cols' is placed column_wise[0, 1]: its columns "
                "are split over ranks, so no rank can score a whole row. Rank against a "
                "row_wise, table_wise or table_row_wise placement of it (load a checkpoint into "
                "such a plan), or gather it (full_tensors()) and use "
                "metrics.target_ranks_from_scores",
                *_nan_errors(world),
                "BuilderError: top_k_items on table 'rows': rank 1: shard_embeddings: table "
                f"'rows': its weight was replaced by a 3 x {DIM} torch.float32 tensor, but this "
                f"rank's block is {8 if world == 3 else 11} x {DIM} torch.float32: a checkpoint "
                "would save or load part of the table. Write new rows into the block in place "
                "(`weight.data.copy_(rows)`, or load a checkpoint), or build the collection again "
                "with shard_embeddings() for another shape or dtype (every rank stops)",
            ]
            assert result["found"]["after"][1].tolist() == [
                o[:3] for o in reference_order(queries, full.tables["rows"].weight.detach())
            ]


def _nan_errors(world: int) -> list[str]:
    """What every rank raises for a NaN query on one rank, then for NaN scores from the row
    the last rank holds (each query meets it once)."""
    query = (
        f"rank {NAN_QUERY_RANK[world]}: queries hold 1 non-finite value(s) (1 NaN, 0 inf), the "
        "first in query 0; a NaN or inf query has no order over the items (a diverged model?): "
        "check the model that made them (every rank stops)"
    )
    queries = sum(BATCHES[world])
    rows = (
        f"{queries} of {queries * ROWS} scores are NaN, from the rows held by rank {world - 1} "
        f"({queries}); the queries are finite, so those rows hold NaN or inf (a diverged "
        "model?). Every rank stops. Check the table's rows (mp.check_finite) and train from an "
        "earlier checkpoint"
    )
    return [
        f"NonFiniteError: top_k_items on table 'rows': {query}",
        f"NonFiniteError: target_ranks on table 'one': {query}",
        f"NonFiniteError: top_k_items on table 'nans': {rows}",
        f"NonFiniteError: target_ranks on table 'nans': {rows}",
    ]


def _rank_2d() -> dict:
    strategy = mp.ManualParallelStrategy()
    mesh = strategy.mesh(replicate=2, shard=2)
    plan = {name: row_wise() for name in TABLES}
    plan["one"] = table_wise(1)
    emb = shard_embeddings(_collection(1), strategy, plan, SGD(lr=0.1), mesh=mesh)
    queries, targets = _inputs(4, strategy.rank)
    found = {}
    for name in ("rows", "one"):
        _, ids = top_k_items(emb, name, queries, K, scores_per_chunk=16)
        found[name] = (ids, target_ranks(emb, name, queries, targets))
    strategy.teardown()
    return found


def test_a_2d_mesh_ranks_inside_each_shard_group() -> None:
    results = run_distributed(_rank_2d, 4, timeout=60)
    full = _collection(1)
    for rank, found in enumerate(results):
        queries, targets = _inputs(4, rank)
        for name, (ids, ranks) in found.items():
            order = reference_order(queries, full.tables[name].weight.detach())
            assert ids.tolist() == [o[:K] for o in order], (name, rank)
            expected = [o.index(t) + 1 for o, t in zip(order, targets.tolist(), strict=True)]
            assert ranks.tolist() == expected, (name, rank)
