"""Exact AUC over a validation set spread across ranks.

AUC is not a mean of per-rank or per-batch values, so the predictions themselves are gathered
(a validation set of a few thousand scores per rank is small) and every rank computes the same
exact, rank-based AUC: the Mann-Whitney statistic, ties counted as one half.
"""

from __future__ import annotations

import torch

from manualpar import ManualParallelStrategy


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a random positive > score of a random negative), ties counting 1/2.

    O(n log n): the positives' average ranks among all scores (tied scores share the mean of
    their ranks). NaN if either class is absent.
    """
    scores, labels = scores.detach().flatten().double(), labels.detach().flatten() > 0.5
    if scores.numel() != labels.numel():
        raise ValueError(f"{scores.numel()} scores but {labels.numel()} labels")
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    ordered, order = scores.sort()
    _, group, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()  # 1-based rank of each tie group's last
    mean_rank = (last - (counts.double() - 1) / 2)[group]
    rank_sum = mean_rank[labels[order]].sum().item()
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def gather(strategy: ManualParallelStrategy, values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values` concatenated in rank order (sizes may differ per rank)."""
    values = values.detach().flatten()
    gathered = strategy.all_gather(torch.tensor([values.numel()], device=values.device))
    sizes: list[int] = gathered.flatten().tolist()
    padded = values.new_zeros(max(sizes))
    padded[: values.numel()] = values
    parts = strategy.all_gather(padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])


def distributed_auc(
    strategy: ManualParallelStrategy, scores: torch.Tensor, labels: torch.Tensor
) -> float:
    """The exact AUC of all ranks' (scores, labels) together; the same value on every rank."""
    return auc(gather(strategy, scores), gather(strategy, labels.to(scores.dtype)))
