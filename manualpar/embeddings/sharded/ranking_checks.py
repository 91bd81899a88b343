"""The ranking's input checks (ranking.py): queries, targets, k and non-finite values, and a
block its table no longer holds (a replaced weight the next step would refuse: ranked_table.py),
agreed by every rank before any scoring collective (`agree`), and NaN scores refused alike on
every rank (`refuse_nan_scores`), each error naming the table, the rank and what to do."""

from __future__ import annotations

import torch

from manualpar.embeddings.sharded.ranked_table import RankedTable
from manualpar.errors import BuilderError, EmbeddingInputError, NonFiniteError

__all__ = [
    "agree",
    "by_rank",
    "check_finite",
    "check_queries",
    "check_targets",
    "refuse_nan_scores",
]


def check_queries(where: RankedTable, queries: torch.Tensor) -> str | None:
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


def check_finite(queries: torch.Tensor) -> str | None:
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


def check_targets(where: RankedTable, queries: torch.Tensor, targets: torch.Tensor) -> str | None:
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


def agree(
    where: RankedTable, caller: str, queries: torch.Tensor, problem: str | None, k: int | None
) -> list[int]:
    """Every rank's batch size; any rank's refused block (BuilderError, first), bad input (or
    NaN/inf query: NonFiniteError) raises on every rank (no one waits)."""
    non_finite = None if problem else check_finite(queries)
    batch = 0 if problem or non_finite else int(queries.shape[0])
    table = f"{caller} on table {where.config.name!r}"
    refused = None if where.refused is None else str(where.refused)
    if where.strategy is None:
        if where.refused is not None:
            raise where.refused
        if problem:
            raise EmbeddingInputError(f"{caller}: {problem}")
        if non_finite:
            raise NonFiniteError(f"{table}: {non_finite}")
        return [batch]
    report = (batch, k, problem, non_finite, where.strategy.rank, refused)
    reports = where.strategy.all_gather_object(report, group=where.group)
    refusals = [f"rank {r[4]}: {r[5]}" for r in reports if r[5]]
    if refusals:
        raise BuilderError(f"{table}: " + "; ".join(refusals) + " (every rank stops)")
    bad = [f"rank {rank}: {p}" for _, _, p, _, rank, _ in reports if p]
    if not bad and len({report[1] for report in reports}) > 1:
        bad = [f"ranks passed different k: {[report[1] for report in reports]}"]
    if bad:
        raise EmbeddingInputError(f"{table}: " + "; ".join(bad) + " (every rank stops)")
    nan = [f"rank {rank}: {n}" for _, _, _, n, rank, _ in reports if n]
    if nan:
        raise NonFiniteError(f"{table}: " + "; ".join(nan) + " (every rank stops)")
    return [report[0] for report in reports]


def by_rank(where: RankedTable, count: torch.Tensor) -> torch.Tensor:
    """(count, global rank) of this rank at its place among the group's, zeros elsewhere: a sum
    over the group gives every rank's pair to every rank."""
    size = 1 if where.strategy is None else where.strategy.group_size(where.group)
    index = 0 if where.strategy is None else where.strategy.group_rank(where.group)
    pairs = torch.zeros((size, 2), dtype=torch.int64, device=count.device)
    pairs[index, 0] = count
    pairs[index, 1] = 0 if where.strategy is None else where.strategy.rank
    return pairs.reshape(-1)


def refuse_nan_scores(where: RankedTable, caller: str, pairs: torch.Tensor, queries: int) -> None:
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
