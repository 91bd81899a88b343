"""The 1-based rank of each query's target among all items, from a full score matrix.

The tie rule (the same as manualpar.embeddings' sharded `target_ranks`): items are ordered by
score, higher first, then by item id, smaller first; so rank = 1 + #{items scoring higher} +
#{items scoring the same with a smaller id}. NaN scores are refused (NonFiniteError): a NaN has
no order, and counting it as anything would rank a diverged model's items by id.
"""

from __future__ import annotations

import torch

from manualpar.errors import MetricError
from manualpar.metrics.nan_check import refuse_nan

__all__ = ["target_ranks_from_scores"]


def target_ranks_from_scores(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, N) scores of every item, (B,) target item ids -> (B,) int64 ranks, 1-based."""
    if scores.dim() != 2 or not scores.is_floating_point():
        raise MetricError(
            "target_ranks_from_scores: scores must be a floating (queries, items) matrix, got "
            f"shape {tuple(scores.shape)} {scores.dtype}"
        )
    batch, items = scores.shape
    if targets.shape != (batch,) or targets.is_floating_point() or targets.dtype == torch.bool:
        raise MetricError(
            f"target_ranks_from_scores: targets must be {batch} integer item ids (one per row of "
            f"scores), got shape {tuple(targets.shape)} {targets.dtype}"
        )
    targets = targets.to(scores.device, torch.int64)
    outside = (targets < 0) | (targets >= items)
    if outside.any():
        at = int(outside.nonzero()[0, 0])
        raise MetricError(
            f"target_ranks_from_scores: target {int(targets[at])} of query {at} is not an item "
            f"id in [0, {items})"
        )
    if torch.isnan(scores).any():
        query = int(torch.isnan(scores).any(dim=1).nonzero()[0, 0])
        refuse_nan(scores, "scores", "target_ranks_from_scores", first=f"query {query}")
    target = scores.gather(1, targets[:, None])
    ids = torch.arange(items, device=scores.device)
    before = (scores > target) | ((scores == target) & (ids < targets[:, None]))
    return 1 + before.sum(dim=1)
