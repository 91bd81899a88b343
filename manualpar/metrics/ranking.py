"""Hit rate, recall, NDCG and MRR at K, from the rank of each query's single target.

With one target per query, recall@K is the hit rate (the target is in the top K or not); NDCG@K
is 1 / log2(rank + 1) for a hit (the ideal DCG of one relevant item is 1); MRR@K is 1 / rank for
a hit. Each is a mean over the queries of every rank: the sums travel, never per-rank means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from manualpar.errors import MetricError
from manualpar.metrics.protocol import sum_over_ranks

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["RankingMetrics"]


class RankingMetrics:
    """`update(ranks)` with each query's 1-based target rank; `compute(strategy)` gives
    hr@K, recall@K, ndcg@K and mrr@K for each K, and the query `count`."""

    def __init__(self, ks: Sequence[int] = (10, 20)) -> None:
        if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
            raise MetricError(f"RankingMetrics: ks must be integers >= 1, got {list(ks)!r}")
        if len(set(ks)) != len(ks):
            raise MetricError(f"RankingMetrics: ks holds a K twice: {list(ks)!r}")
        self.ks = tuple(ks)
        self._sums: torch.Tensor | None = None  # count, then hits, ndcg, mrr for each K

    def reset(self) -> None:
        self._sums = None

    @torch.no_grad()
    def update(self, ranks: torch.Tensor) -> None:
        """Add queries whose targets ranked `ranks` (integers >= 1, any shape)."""
        if ranks.is_floating_point() or ranks.is_complex() or ranks.dtype == torch.bool:
            raise MetricError(
                f"RankingMetrics.update: ranks must be an integer tensor, got {ranks.dtype} "
                "(1-based ranks, e.g. from target_ranks_from_scores)"
            )
        flat = ranks.detach().reshape(-1)
        if flat.numel() and int(flat.min()) < 1:
            at = int(flat.argmin())
            raise MetricError(
                f"RankingMetrics.update: ranks are 1-based, got {int(flat[at])} at position "
                f"{at} of {flat.numel()}"
            )
        rank = flat.to(torch.float64)
        ks = torch.tensor(self.ks, dtype=torch.float64, device=rank.device)
        hit = (rank[None, :] <= ks[:, None]).to(torch.float64)  # (K, queries)
        sums = torch.cat(
            [
                torch.tensor([float(rank.numel())], dtype=torch.float64, device=rank.device),
                hit.sum(dim=1),
                (hit / torch.log2(rank + 1)).sum(dim=1),
                (hit / rank).sum(dim=1),
            ]
        )
        self._sums = sums if self._sums is None else self._sums + sums.to(self._sums.device)

    def compute(self, strategy: ManualParallelStrategy | None = None) -> dict[str, float]:
        """Means over every rank's queries (collective: every rank calls it)."""
        width = 1 + 3 * len(self.ks)
        local = self._sums if self._sums is not None else torch.zeros(width, dtype=torch.float64)
        sums = sum_over_ranks(local, strategy).tolist()
        count = sums[0]
        if count == 0:
            raise MetricError(
                "RankingMetrics.compute: no query was added on any rank; call update(ranks) "
                "before compute"
            )
        n = len(self.ks)
        result: dict[str, float] = {}
        for i, k in enumerate(self.ks):
            hits = sums[1 + i] / count
            result[f"hr@{k}"] = hits
            result[f"recall@{k}"] = hits
            result[f"ndcg@{k}"] = sums[1 + n + i] / count
            result[f"mrr@{k}"] = sums[1 + 2 * n + i] / count
        result["count"] = count
        return result
