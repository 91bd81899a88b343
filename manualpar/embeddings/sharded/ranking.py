"""Ranking queries against every row of one table, without gathering the table.

    scores, ids = top_k_items(emb, "item", user_vectors, k=100)    # (B, 100) each
    ranks = target_ranks(emb, "item", user_vectors, next_items)     # (B,) 1-based

Every rank calls these together with its own batch of queries (its size may differ, 0
included). The queries travel (one all_gather), each rank scores all of them against the rows
it holds, chunk by chunk (at most `scores_per_chunk` scores at a time), and:
- top_k_items: each rank keeps its k best per query and sends them to the query's rank (one
  all_to_all), which merges them;
- target_ranks: the target row's owner scores it (one all_reduce of the target scores), each
  rank counts the items of its rows ranking before the target, and the counts are summed (one
  all_reduce).
The order is the same on every layout: higher score first, then smaller item id (scores are
summed in float64 and rounded to float32 once: kernels/scoring.py). An unsharded collection and
a data-parallel table are scored here alone; a column-wise table is refused (no rank holds a
whole row).

NaN has no order: a NaN or inf query is refused with the other bad inputs, before any scoring
collective; NaN scores (rows holding NaN or inf) are counted on each rank and the counts travel
with the last collective (the all_to_all, the counts' all_reduce), so every rank refuses alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.kernels.scoring import (
    SENTINEL_ID,
    best_k,
    chunk_top_k,
    count_before,
    lowest_nan_,
    score_rows,
)
from manualpar.embeddings.modules.bag_collection import EmbeddingBagCollection, table_of
from manualpar.embeddings.modules.sequence_collection import EmbeddingCollection
from manualpar.embeddings.sharded.sharded_tables import ShardedTables
from manualpar.errors import (
    ConfigError,
    ConfigTypeError,
    EmbeddingInputError,
    NonFiniteError,
    PlanError,
)
from manualpar.strategy.uneven import all_gather_uneven

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["DEFAULT_SCORES_PER_CHUNK", "target_ranks", "top_k_items"]

DEFAULT_SCORES_PER_CHUNK = 1 << 22  # 4M scores: about 64 MiB of temporaries
QUERIES_PER_CHUNK = 1024
Collection = EmbeddingBagCollection | EmbeddingCollection | ShardedTables
Chunks = Callable[[int], Iterator[tuple[int, torch.Tensor]]]


@dataclass(frozen=True)
class _Table:
    """One table as the ranking sees it: this rank's rows, and who else holds the others."""

    config: EmbeddingBagConfig
    device: torch.device
    chunks: Chunks  # (first item id, rows) pieces of this rank's rows, of at most n rows
    strategy: ManualParallelStrategy | None = None  # None: this process holds every row
    group: Any = None  # the ranks holding one copy of the table (a 2-D mesh's shard dim)


def top_k_items(
    emb: Collection,
    table: str,
    queries: torch.Tensor,
    k: int,
    *,
    scores_per_chunk: int = DEFAULT_SCORES_PER_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k items scoring highest against each of this rank's (B, dim) `queries`, best first:
    (B, k) float32 scores and (B, k) int64 item ids (table rows). Collective."""
    _check_chunk(scores_per_chunk)
    where = _table(emb, table, "top_k_items")
    n = where.config.num_embeddings
    problem = _check_queries(where, queries)
    if problem is None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n):
        problem = f"k must be an int in [1, {n}] (the table's rows), got {k!r}"
    batches = _agree(where, "top_k_items", queries, problem, k)
    if sum(batches) == 0:  # no rank has a query: read no row
        return torch.zeros((0, k), device=where.device), torch.zeros(
            (0, k), dtype=torch.int64, device=where.device
        )
    everyone = _gather(where, queries.detach().to(where.device, torch.float32), batches)
    top_scores, top_ids, nans = _local_top_k(where, everyone.to(torch.float64), k, scores_per_chunk)
    return _merge(where, top_scores, top_ids, nans, batches, k)


def target_ranks(
    emb: Collection,
    table: str,
    queries: torch.Tensor,
    targets: torch.Tensor,
    *,
    scores_per_chunk: int = DEFAULT_SCORES_PER_CHUNK,
) -> torch.Tensor:
    """(B,) int64 1-based rank of each target item among all rows for its query: 1 + items
    scoring higher + items scoring the same with a smaller id. Collective."""
    _check_chunk(scores_per_chunk)
    where = _table(emb, table, "target_ranks")
    problem = _check_queries(where, queries) or _check_targets(where, queries, targets)
    batches = _agree(where, "target_ranks", queries, problem, None)
    if sum(batches) == 0:  # no rank has a query: read no row
        return torch.zeros(0, dtype=torch.int64, device=where.device)
    everyone = _gather(where, queries.detach().to(where.device, torch.float32), batches)
    everyone = everyone.to(torch.float64)
    wanted = _gather(where, targets.detach().to(where.device, torch.int64), batches)
    target_scores = _sum(where, _target_scores(where, everyone, wanted), "target scores")
    counts = torch.zeros(len(wanted), dtype=torch.int64, device=where.device)
    nans = torch.zeros((), dtype=torch.int64, device=where.device)
    step = _queries_per_chunk(len(wanted), scores_per_chunk)
    for first, rows in where.chunks(max(1, scores_per_chunk // step)):
        for q in range(0, len(wanted), step):
            scores = score_rows(everyone[q : q + step], rows)
            nans += lowest_nan_(scores)
            counts[q : q + step] += count_before(
                scores, first, target_scores[q : q + step], wanted[q : q + step]
            )
    # the NaN counts of every rank ride with the counts: every rank refuses alike
    summed = _sum(where, torch.cat([counts, _by_rank(where, nans)]), "counts")
    _refuse_nan_scores(where, "target_ranks", summed[len(wanted) :], len(wanted))
    return 1 + _mine(where, summed[: len(wanted)], batches)


# ---- the table on this rank ------------------------------------------------------------------
def _table(emb: Collection, name: str, caller: str) -> _Table:
    configs = {config.name: config for config in getattr(emb, "configs", ())}
    if not isinstance(emb, Collection) or name not in configs:
        what = type(emb).__name__
        raise EmbeddingInputError(
            f"{caller}: no table {name!r} in the {what}"
            + (f" (its tables: {sorted(configs)})" if configs else "")
            + "; pass an EmbeddingBagCollection, EmbeddingCollection or one from "
            "shard_embeddings, and one of its table names"
        )
    config = configs[name]
    if not isinstance(emb, ShardedTables):
        weight = table_of(emb.tables, name).weight.detach()
        if weight.is_meta:
            raise EmbeddingInputError(
                f"{caller}: table {name!r} is on the meta device (no values yet); materialize "
                "the collection or shard it with shard_embeddings first"
            )
        return _Table(config, weight.device, _pieces([(0, weight)], None))
    placement = emb.plan.tables[name]
    if emb.routing.splits_cols(list(configs).index(name)):
        raise PlanError(
            f"{caller}: table {name!r} is placed {placement}: its columns are split over ranks, "
            "so no rank can score a whole row. Rank against a row_wise, table_wise or "
            "table_row_wise placement of it (load a checkpoint into such a plan), or gather "
            "it (full_tensors()) and use metrics.target_ranks_from_scores"
        )
    block = emb.blocks.by_name[name]
    shard, store = block.shard, block.store
    if shard is None or store is None:
        pieces = _pieces([], None)
    else:
        chunks = [(shard.row_start + start, rows) for start, rows in store.checkpoint_chunks(None)]
        pieces = _pieces(chunks, store.drop_pages)  # a disk tier's, one file chunk at a time
    if placement.sharding == "data_parallel":
        return _Table(config, emb.device, pieces)
    return _Table(config, emb.device, pieces, emb.strategy, emb.mesh.shard)


def _pieces(
    chunks: list[tuple[int, torch.Tensor]], drop_pages: Callable[[], None] | None
) -> Chunks:
    def pieces(rows: int) -> Iterator[tuple[int, torch.Tensor]]:
        for first, block in chunks:
            for start in range(0, block.shape[0], rows):
                if drop_pages is not None:
                    drop_pages()
                yield first + start, block[start : start + rows].detach()
        if drop_pages is not None:
            drop_pages()

    return pieces


# ---- checks and agreement ---------------------------------------------------------------------
def _check_queries(where: _Table, queries: torch.Tensor) -> str | None:
    dim = where.config.embedding_dim
    if (
        not isinstance(queries, torch.Tensor)
        or queries.dim() != 2
        or queries.shape[1] != dim
        or not queries.is_floating_point()
    ):
        shape = tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries)
        dtype = f" {queries.dtype}" if isinstance(queries, torch.Tensor) else ""
        return (
            f"queries must be a floating (batch, {dim}) tensor for table "
            f"{where.config.name!r}, got {shape}{dtype}"
        )
    return None


def _check_finite(queries: torch.Tensor) -> str | None:
    """What is wrong with queries holding NaN or inf (they have no order over the items)."""
    bad = ~torch.isfinite(queries.detach())
    if not bool(bad.any()):
        return None
    nans = int(torch.isnan(queries.detach()).sum())
    total, first = int(bad.sum()), int(bad.any(dim=1).nonzero()[0, 0])
    return (
        f"queries hold {total} non-finite value(s) ({nans} NaN, {total - nans} inf), the first in "
        f"query {first}; a NaN or inf query has no order over the items (a diverged model?): "
        "check the model that made them"
    )


def _check_targets(where: _Table, queries: torch.Tensor, targets: torch.Tensor) -> str | None:
    rows = where.config.num_embeddings
    if (
        not isinstance(targets, torch.Tensor)
        or targets.shape != (queries.shape[0],)
        or targets.is_floating_point()
        or targets.dtype == torch.bool
    ):
        shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets)
        return f"targets must be {queries.shape[0]} integer item ids (one per query), got {shape}"
    outside = (targets < 0) | (targets >= rows)
    if outside.any():
        at = int(outside.nonzero()[0, 0])
        return (
            f"target {int(targets[at])} of query {at} is not a row of table "
            f"{where.config.name!r} [0, {rows})"
        )
    return None


def _agree(
    where: _Table, caller: str, queries: torch.Tensor, problem: str | None, k: int | None
) -> list[int]:
    """Every rank's batch size; any rank's bad input (or NaN/inf query: NonFiniteError) raises
    on every rank (no one waits)."""
    non_finite = None if problem else _check_finite(queries)
    batch = 0 if problem or non_finite else int(queries.shape[0])
    table = f"{caller} on table {where.config.name!r}"
    if where.strategy is None:
        if problem:
            raise EmbeddingInputError(f"{caller}: {problem}")
        if non_finite:
            raise NonFiniteError(f"{table}: {non_finite}")
        return [batch]
    report = (batch, k, problem, non_finite, where.strategy.rank)
    reports = where.strategy.all_gather_object(report, group=where.group)
    bad = [f"rank {rank}: {p}" for _, _, p, _, rank in reports if p]
    if not bad and len({report[1] for report in reports}) > 1:
        bad = [f"ranks passed different k: {[report[1] for report in reports]}"]
    if bad:
        raise EmbeddingInputError(f"{table}: " + "; ".join(bad) + " (every rank stops)")
    nan = [f"rank {rank}: {n}" for _, _, _, n, rank in reports if n]
    if nan:
        raise NonFiniteError(f"{table}: " + "; ".join(nan) + " (every rank stops)")
    return [report[0] for report in reports]


def _by_rank(where: _Table, count: torch.Tensor) -> torch.Tensor:
    """(count, global rank) of this rank at its place among the group's, zeros elsewhere: a sum
    over the group gives every rank's pair to every rank."""
    size = 1 if where.strategy is None else where.strategy.group_size(where.group)
    index = 0 if where.strategy is None else where.strategy.group_rank(where.group)
    pairs = torch.zeros((size, 2), dtype=torch.int64, device=count.device)
    pairs[index, 0] = count
    pairs[index, 1] = 0 if where.strategy is None else where.strategy.rank
    return pairs.reshape(-1)


def _refuse_nan_scores(where: _Table, caller: str, pairs: torch.Tensor, queries: int) -> None:
    """NonFiniteError when any rank scored a NaN; `pairs` is every rank's (count, global rank),
    the same on every rank, so every rank raises or none does."""
    found = pairs.reshape(-1, 2).tolist()
    total = sum(count for count, _ in found)
    if total == 0:
        return
    scores = queries * where.config.num_embeddings
    held, whose, stops = "", "the table's", ""
    if where.strategy is not None:
        ranks = ", ".join(f"rank {rank} ({count})" for count, rank in found if count)
        held, whose, stops = f", from the rows held by {ranks}", "those", " Every rank stops."
    raise NonFiniteError(
        f"{caller} on table {where.config.name!r}: {total} of {scores} scores are NaN{held}; "
        f"the queries are finite, so {whose} rows hold NaN or inf (a diverged model?).{stops} "
        "Check the table's rows (mp.check_finite) and train from an earlier checkpoint"
    )


# ---- collectives (none without a strategy) ----------------------------------------------------
def _gather(where: _Table, tensor: torch.Tensor, batches: list[int]) -> torch.Tensor:
    if where.strategy is None:
        return tensor
    parts = all_gather_uneven(where.strategy, tensor, group=where.group, lengths=batches)
    return torch.cat(parts)


def _sum(where: _Table, tensor: torch.Tensor, what: str) -> torch.Tensor:
    if where.strategy is None:
        return tensor
    name = f"ranking table {where.config.name!r}: {what}"
    return where.strategy.all_reduce_(tensor, "sum", name=name, group=where.group)


def _mine(where: _Table, tensor: torch.Tensor, batches: list[int]) -> torch.Tensor:
    """This rank's rows of a tensor over every rank's queries."""
    if where.strategy is None:
        return tensor
    index = where.strategy.group_rank(where.group)
    start = sum(batches[:index])
    return tensor[start : start + batches[index]]


# ---- scoring ----------------------------------------------------------------------------------
def _check_chunk(scores_per_chunk: int) -> None:
    if isinstance(scores_per_chunk, bool) or not isinstance(scores_per_chunk, int):
        raise ConfigTypeError(f"scores_per_chunk must be an int, got {scores_per_chunk!r}")
    if scores_per_chunk < 1:
        raise ConfigError(f"scores_per_chunk must be >= 1, got {scores_per_chunk}")


def _queries_per_chunk(queries: int, scores_per_chunk: int) -> int:
    return max(1, min(queries, QUERIES_PER_CHUNK, scores_per_chunk))


def _local_top_k(
    where: _Table, queries: torch.Tensor, k: int, scores_per_chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query's k best among this rank's rows, padded with (-inf, SENTINEL_ID), and the
    number of NaN scores (counted as -inf)."""
    count = len(queries)
    nans = torch.zeros((), dtype=torch.int64, device=where.device)
    scores = torch.full((count, k), float("-inf"), device=where.device)
    ids = torch.full((count, k), SENTINEL_ID, dtype=torch.int64, device=where.device)
    step = _queries_per_chunk(count, scores_per_chunk)
    for first, rows in where.chunks(max(1, scores_per_chunk // step)):
        for q in range(0, count, step):
            scores_here = score_rows(queries[q : q + step], rows)
            nans += lowest_nan_(scores_here)
            chunk_scores, chunk_ids = chunk_top_k(scores_here, first, k)
            scores[q : q + step], ids[q : q + step] = best_k(
                torch.cat([scores[q : q + step], chunk_scores], dim=1),
                torch.cat([ids[q : q + step], chunk_ids], dim=1),
                k,
            )
    return scores, ids, nans


def _merge(
    where: _Table,
    scores: torch.Tensor,
    ids: torch.Tensor,
    nans: torch.Tensor,
    batches: list[int],
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each rank the candidates of its queries (one all_to_all) and keep the k best. Each
    rank's (NaN count, rank) rides at the end of what it sends every rank, so every rank knows
    them all and refuses alike."""
    if where.strategy is None:
        _refuse_nan_scores(where, "top_k_items", _by_rank(where, nans), sum(batches))
        return scores, ids
    packed = torch.stack([scores.view(torch.int32).to(torch.int64), ids], dim=-1).reshape(-1)
    tail = torch.stack([nans, torch.tensor(where.strategy.rank, device=nans.device)])
    parts = packed.split([b * k * 2 for b in batches])
    mine = batches[where.strategy.group_rank(where.group)]
    received = where.strategy.all_to_all(
        torch.cat([piece for part in parts for piece in (part, tail)]),
        [b * k * 2 + 2 for b in batches],
        [mine * k * 2 + 2] * len(batches),
        name=f"top_k_items on table {where.config.name!r}: candidates",
        group=where.group,
    ).view(len(batches), mine * k * 2 + 2)
    _refuse_nan_scores(where, "top_k_items", received[:, -2:].reshape(-1), sum(batches))
    received = received[:, :-2].reshape(len(batches), mine, k, 2)
    candidates = received.permute(1, 0, 2, 3).reshape(mine, len(batches) * k, 2)
    theirs = candidates[..., 0].to(torch.int32).view(torch.float32)
    return best_k(theirs, candidates[..., 1].contiguous(), k)


def _target_scores(where: _Table, queries: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each target's score where this rank holds its row, 0 elsewhere (the owner's counts)."""
    scores = torch.zeros(len(targets), device=where.device)
    for first, rows in where.chunks(1 << 16):
        here = ((targets >= first) & (targets < first + len(rows))).nonzero()[:, 0]
        if len(here):
            row = rows[targets[here] - first].to(torch.float64)
            dot = (queries[here] * row).sum(dim=1).to(torch.float32)
            scores[here] = dot.nan_to_num(
                nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")
            )
    return scores
