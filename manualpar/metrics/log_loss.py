"""Log loss (binary cross-entropy) and normalized entropy over the samples of every rank.

Normalized entropy is the log loss divided by the entropy of the global positive rate p,
-(p log p + (1 - p) log(1 - p)): below 1 the model beats predicting p for everyone. Both come
from three float64 sums (loss, samples, positives), all-reduced once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from manualpar.errors import MetricError
from manualpar.metrics.nan_check import refuse_nan
from manualpar.metrics.protocol import sum_over_ranks

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["LogLoss", "logit_loss_sum"]


def logit_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed binary cross-entropy of float64 `logits` (no NaN) for labels in [0, 1].

    An infinite logit costs its limit: 0 when it agrees with a hard label (+inf with 1, -inf
    with 0), inf otherwise. torch's formula gives NaN for the agreeing case (inf - inf), which
    would turn a model's most confident right answers into a NaN loss."""
    finite = torch.isfinite(logits)
    loss = F.binary_cross_entropy_with_logits(logits[finite], labels[finite], reduction="sum")
    infinite, label = logits[~finite], labels[~finite]
    wrong = torch.where(infinite > 0, 1 - label, label)  # the weight of the infinite term
    return loss + (math.inf if bool((wrong > 0).any()) else 0.0)


class LogLoss:
    """`update(logits, labels)` (with `from_logits=False`: probabilities) and labels in [0, 1];
    `compute(strategy)` gives `log_loss`, `normalized_entropy` and the sample `count`.

    Probabilities go through torch's binary_cross_entropy (a log is clamped at -100, so a
    confident wrong 0 or 1 costs 100, not inf); logits through the stable
    binary_cross_entropy_with_logits, an infinite logit at its limit (`logit_loss_sum`). NaN
    predictions are refused (NonFiniteError). The normalized entropy is NaN when every label is
    0 or every label is 1 (the entropy it divides by is 0).
    """

    def __init__(self, from_logits: bool = True) -> None:
        self.from_logits = from_logits
        self._sums: torch.Tensor | None = None  # loss, samples, positives

    def reset(self) -> None:
        self._sums = None

    @torch.no_grad()
    def update(self, predictions: torch.Tensor, labels: torch.Tensor) -> None:
        what = "logits" if self.from_logits else "probabilities"
        if predictions.numel() != labels.numel():
            raise MetricError(
                f"LogLoss.update: {predictions.numel()} {what} but {labels.numel()} labels; "
                "give one label per prediction"
            )
        x = predictions.detach().reshape(-1).to(torch.float64)
        y = labels.detach().reshape(-1).to(x.device, torch.float64)
        refuse_nan(x, what, "LogLoss.update")
        if ((y < 0) | (y > 1) | torch.isnan(y)).any():
            raise MetricError("LogLoss.update: labels must lie in [0, 1]")
        if not self.from_logits and ((x < 0) | (x > 1)).any():
            raise MetricError(
                "LogLoss.update: probabilities must lie in [0, 1]; pass logits with "
                "LogLoss(from_logits=True)"
            )
        loss = (
            logit_loss_sum(x, y)
            if self.from_logits
            else F.binary_cross_entropy(x, y, reduction="sum")
        )
        sums = torch.stack(
            [loss, torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device), y.sum()]
        )
        self._sums = sums if self._sums is None else self._sums + sums.to(self._sums.device)

    def compute(self, strategy: ManualParallelStrategy | None = None) -> dict[str, float]:
        """Over every rank's samples (collective: every rank calls it)."""
        local = self._sums if self._sums is not None else torch.zeros(3, dtype=torch.float64)
        loss, count, positives = sum_over_ranks(local, strategy).tolist()
        if count == 0:
            raise MetricError(
                "LogLoss.compute: no sample was added on any rank; call update(...) before compute"
            )
        rate = positives / count
        entropy = (
            -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if 0 < rate < 1 else 0.0
        )
        log_loss = loss / count
        return {
            "log_loss": log_loss,
            "normalized_entropy": log_loss / entropy if entropy > 0 else math.nan,
            "count": count,
        }
