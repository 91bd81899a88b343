"""The click-through-rate bundle: AUC, log loss, normalized entropy and calibration in one
object, from one gather of (prediction, label) pairs.

A CTR job wants all four after every validation pass; three separate objects each gathered or
summed their own copy of the same samples. Calibration is the predicted CTR over the observed
one (mean predicted probability / positive rate): 1 when the model's rates are unbiased.
The sums run over the pairs sorted, so the same samples give the same bits however they were
split over ranks or ordered: a one-process scoring run reproduces a validation pass exactly.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from manualpar.errors import MetricError
from manualpar.metrics.auc import exact_auc
from manualpar.metrics.log_loss import logit_loss_sum
from manualpar.metrics.nan_check import refuse_nan
from manualpar.metrics.protocol import gather_rows

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["CTRMetrics"]


class CTRMetrics:
    """`update(logits, labels)` (probabilities with `from_logits=False`) and 0/1 labels;
    `compute(strategy)` gives `auc`, `log_loss`, `normalized_entropy`, `calibration` and the
    sample `count`, exact over every rank's samples (the pairs are gathered: 16 bytes a
    sample, as for `AUC`)."""

    def __init__(self, from_logits: bool = True) -> None:
        self.from_logits = from_logits
        self._parts: list[torch.Tensor] = []  # (n, 2) float64: prediction, label

    def reset(self) -> None:
        self._parts = []

    @torch.no_grad()
    def update(self, predictions: torch.Tensor, labels: torch.Tensor) -> None:
        what = "logits" if self.from_logits else "probabilities"
        if predictions.numel() != labels.numel():
            raise MetricError(
                f"CTRMetrics.update: {predictions.numel()} {what} but {labels.numel()} labels; "
                "give one label per prediction"
            )
        x = predictions.detach().reshape(-1).to(torch.float64)
        y = labels.detach().reshape(-1).to(torch.float64, copy=True).to(x.device)
        refuse_nan(x, what, "CTRMetrics.update")
        if ((y != 0) & (y != 1)).any():
            raise MetricError(
                "CTRMetrics.update: labels must be 0 or 1, got "
                f"{sorted(set(y[(y != 0) & (y != 1)].tolist()))[:5]}"
            )
        if not self.from_logits and ((x < 0) | (x > 1)).any():
            raise MetricError(
                "CTRMetrics.update: probabilities must lie in [0, 1]; pass logits with "
                "CTRMetrics(from_logits=True)"
            )
        self._parts.append(torch.stack([x, y], dim=1))

    def compute(self, strategy: ManualParallelStrategy | None = None) -> dict[str, float]:
        """Over every rank's samples (collective: every rank calls it)."""
        local = torch.cat(self._parts) if self._parts else torch.zeros((0, 2), dtype=torch.float64)
        pairs = gather_rows(local, strategy)
        if pairs.shape[0] == 0:
            raise MetricError(
                "CTRMetrics.compute: no sample was added on any rank; call update(...) before "
                "compute"
            )
        x, y = _canonical_order(pairs)
        auc = exact_auc(x, y == 1)  # refuses one class, naming it
        if self.from_logits:
            loss = logit_loss_sum(x, y)
            predicted = torch.sigmoid(x)
        else:
            loss, predicted = F.binary_cross_entropy(x, y, reduction="sum"), x
        count = float(pairs.shape[0])
        rate = float(y.sum()) / count
        entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
        log_loss = float(loss) / count
        return {
            "auc": auc,
            "log_loss": log_loss,
            "normalized_entropy": log_loss / entropy,
            "calibration": float(predicted.sum()) / count / rate,
            "count": count,
        }


def _canonical_order(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions and labels sorted by (prediction, label): float64 sums depend on the order
    of their terms, and the order of gathered pairs on the ranks' split of the samples."""
    by_label = torch.sort(pairs[:, 1], stable=True).indices
    order = by_label[torch.sort(pairs[by_label, 0], stable=True).indices]
    return pairs[order, 0], pairs[order, 1]
