"""Scoring queries against a chunk of table rows: dot products, the k best, the rank of a target.

The order everywhere: higher score first, then smaller item id. A score is float32, but the dot
product is summed in float64 and rounded once, so the same (query, row) gets the same bits
whatever the chunk, the block or the BLAS kernel (float32 sums in another order can differ in
the last bit, which would break ties differently on another layout). NaN scores are counted
(`lowest_nan_`; the caller refuses them) and count as -inf meanwhile, so a chunk's k best and
its counts stay well defined until every rank knows.
"""

from __future__ import annotations

import torch

__all__ = ["SENTINEL_ID", "best_k", "chunk_top_k", "count_before", "lowest_nan_", "score_rows"]

# the id of a padding candidate (a rank with fewer than k rows): it loses every tie
SENTINEL_ID = torch.iinfo(torch.int64).max


def score_rows(queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(q, dim) float64 queries x (r, dim) rows of any float dtype -> (q, r) float32 scores
    (NaN where a row holds NaN or inf: see `lowest_nan_`)."""
    return (queries @ rows.to(torch.float64).T).to(torch.float32)


def lowest_nan_(scores: torch.Tensor) -> torch.Tensor:
    """Set the NaN `scores` to -inf in place; their count (a 0-d int64 tensor, no host sync)."""
    nans = torch.isnan(scores)
    scores.masked_fill_(nans, float("-inf"))
    return nans.sum()


def best_k(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best (score, id) candidates of each row, in order (ids may come in any order)."""
    by_id = ids.argsort(dim=1, stable=True)
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    by_score = scores.argsort(dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, by_score), ids.gather(1, by_score)


def chunk_top_k(scores: torch.Tensor, first_id: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The min(k, r) best of a (q, r) chunk whose columns are items first_id, first_id + 1, ...

    torch.topk may return any of several tied items; here the tied ones kept at the cut are
    the first columns (the smaller ids): everything above the k-th score, then as many of the
    items equal to it as there is room for.
    """
    queries, items = scores.shape
    k = min(k, items)
    kth = scores.topk(k, dim=1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=1, keepdim=True)
    keep = above | (tied & (tied.cumsum(dim=1) <= room))
    columns = keep.nonzero()[:, 1].view(queries, k)  # exactly k per row, in column order
    return best_k(scores.gather(1, columns), columns + first_id, k)


def count_before(
    scores: torch.Tensor, first_id: int, target_scores: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """(q,) how many items of the (q, r) chunk (ids first_id, ...) rank before each target:
    a higher score, or the same score and a smaller id. The target itself never counts."""
    ids = torch.arange(first_id, first_id + scores.shape[1], device=scores.device)
    target_score, target = target_scores[:, None], targets[:, None]
    higher = (scores > target_score) & (ids != target)
    same = (scores == target_score) & (ids < target)
    return (higher | same).sum(dim=1)
