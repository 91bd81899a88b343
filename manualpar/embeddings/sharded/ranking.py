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
The table as this rank holds it and its collectives are ranked_table.py's; the checks,
ranking_checks.py's.
"""

from __future__ import annotations

import torch

from manualpar.embeddings.kernels.scoring import (
    SENTINEL_ID,
    best_k,
    chunk_top_k,
    count_before,
    lowest_nan_,
    score_rows,
)
from manualpar.embeddings.sharded.ranked_table import (
    Collection,
    RankedTable,
    gather,
    mine,
    ranked_table,
    sum_over,
)
from manualpar.embeddings.sharded.ranking_checks import (
    agree,
    by_rank,
    check_queries,
    check_targets,
    refuse_nan_scores,
)
from manualpar.errors import ConfigError, ConfigTypeError

__all__ = ["DEFAULT_SCORES_PER_CHUNK", "target_ranks", "top_k_items"]

DEFAULT_SCORES_PER_CHUNK = 1 << 22  # 4M scores: about 64 MiB of temporaries
QUERIES_PER_CHUNK = 1024


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
    where = ranked_table(emb, table, "top_k_items")
    n = where.config.num_embeddings
    problem = check_queries(where, queries)
    if problem is None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n):
        problem = f"k must be an int in [1, {n}] (the table's rows), got {k!r}"
    batches = agree(where, "top_k_items", queries, problem, k)
    if sum(batches) == 0:  # no rank has a query: read no row
        return torch.zeros((0, k), device=where.device), torch.zeros(
            (0, k), dtype=torch.int64, device=where.device
        )
    everyone = gather(where, queries.detach().to(where.device, torch.float32), batches)
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
    where = ranked_table(emb, table, "target_ranks")
    problem = check_queries(where, queries) or check_targets(where, queries, targets)
    batches = agree(where, "target_ranks", queries, problem, None)
    if sum(batches) == 0:  # no rank has a query: read no row
        return torch.zeros(0, dtype=torch.int64, device=where.device)
    everyone = gather(where, queries.detach().to(where.device, torch.float32), batches)
    everyone = everyone.to(torch.float64)
    wanted = gather(where, targets.detach().to(where.device, torch.int64), batches)
    target_scores = sum_over(where, _target_scores(where, everyone, wanted), "target scores")
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
    summed = sum_over(where, torch.cat([counts, by_rank(where, nans)]), "counts")
    refuse_nan_scores(where, "target_ranks", summed[len(wanted) :], len(wanted))
    return 1 + mine(where, summed[: len(wanted)], batches)


def _check_chunk(scores_per_chunk: int) -> None:
    if isinstance(scores_per_chunk, bool) or not isinstance(scores_per_chunk, int):
        raise ConfigTypeError(f"scores_per_chunk must be an int, got {scores_per_chunk!r}")
    if scores_per_chunk < 1:
        raise ConfigError(f"scores_per_chunk must be >= 1, got {scores_per_chunk}")


def _queries_per_chunk(queries: int, scores_per_chunk: int) -> int:
    return max(1, min(queries, QUERIES_PER_CHUNK, scores_per_chunk))


def _local_top_k(
    where: RankedTable, queries: torch.Tensor, k: int, scores_per_chunk: int
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
    where: RankedTable,
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
        refuse_nan_scores(where, "top_k_items", by_rank(where, nans), sum(batches))
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
    refuse_nan_scores(where, "top_k_items", received[:, -2:].reshape(-1), sum(batches))
    received = received[:, :-2].reshape(len(batches), mine, k, 2)
    candidates = received.permute(1, 0, 2, 3).reshape(mine, len(batches) * k, 2)
    theirs = candidates[..., 0].to(torch.int32).view(torch.float32)
    return best_k(theirs, candidates[..., 1].contiguous(), k)


def _target_scores(
    where: RankedTable, queries: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
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
