"""ROC AUC, exact and tie-aware, over the samples of every rank.

AUC is the probability that a random positive scores above a random negative, a tie counting
1/2 (Mann-Whitney): (sum of the positives' average ranks - P(P+1)/2) / (P N), tied scores
sharing the mean of their ranks. It is not additive, so `compute` gathers every rank's
(score, label) pairs (ranks may hold different numbers, none included) and every rank computes
the same value from the same pairs. Twice the rank sum is an integer, kept in int64 until the
last division.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from manualpar.errors import MetricError
from manualpar.metrics.nan_check import refuse_nan
from manualpar.metrics.protocol import gather_rows

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["AUC", "exact_auc"]


def exact_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """AUC of 1-D `scores` for boolean `labels`; ValueError when a class is missing."""
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        raise MetricError(
            f"AUC: needs both classes, got {positives} positive and {negatives} negative "
            "samples over all ranks; AUC is undefined with one class (evaluate on more samples)"
        )
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0)
    twice_mean_rank = 2 * ends - counts + 1  # tied scores share the mean of their ranks
    twice_rank_sum = int(twice_mean_rank[inverse][labels].sum())
    return (twice_rank_sum - positives * (positives + 1)) / (2 * positives * negatives)


class AUC:
    """`update(scores, labels)` with any real scores (higher: more likely positive) and 0/1
    labels; `compute(strategy)` gives `auc` and the sample `count`."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []  # (n, 2) float64: score, label

    def reset(self) -> None:
        self._parts = []

    @torch.no_grad()
    def update(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        if scores.numel() != labels.numel():
            raise MetricError(
                f"AUC.update: {scores.numel()} scores but {labels.numel()} labels; give one "
                "label per score"
            )
        score = scores.detach().reshape(-1).to(torch.float64)
        label = labels.detach().reshape(-1).to(torch.float64, copy=True).to(score.device)
        refuse_nan(score, "scores", "AUC.update")
        if ((label != 0) & (label != 1)).any():
            raise MetricError(
                "AUC.update: labels must be 0 or 1, got "
                f"{sorted(set(label[(label != 0) & (label != 1)].tolist()))[:5]}"
            )
        self._parts.append(torch.stack([score, label], dim=1))

    def compute(self, strategy: ManualParallelStrategy | None = None) -> dict[str, float]:
        """AUC over every rank's samples (collective: every rank calls it)."""
        local = torch.cat(self._parts) if self._parts else torch.zeros((0, 2), dtype=torch.float64)
        pairs = gather_rows(local, strategy)
        auc = exact_auc(pairs[:, 0], pairs[:, 1] == 1)
        return {"auc": auc, "count": float(pairs.shape[0])}
