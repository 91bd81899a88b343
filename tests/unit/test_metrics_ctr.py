"""CTRMetrics against each formula written out, and validation_step's metric objects returned
together: a key two of them compute (`count`) is namespaced by their names, not refused."""

from __future__ import annotations

import math

import pytest
import torch

from manualpar.errors import MetricError
from manualpar.loop.metric_objects import compute_metrics
from manualpar.metrics import AUC, CTRMetrics, LogLoss


def _pairs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(40, generator=g), (torch.rand(40, generator=g) < 0.3).long()


def test_ctr_metrics_equal_their_formulas() -> None:
    logits, labels = _pairs()
    ctr = CTRMetrics()
    ctr.update(logits[:25], labels[:25])
    ctr.update(logits[25:], labels[25:])
    got = ctr.compute()
    p = torch.sigmoid(logits.double()).tolist()
    y = labels.double().tolist()
    loss = (
        -sum(yi * math.log(pi) + (1 - yi) * math.log(1 - pi) for pi, yi in zip(p, y, strict=True))
        / 40
    )
    rate = sum(y) / 40
    pos = [pi for pi, yi in zip(p, y, strict=True) if yi == 1]
    neg = [pi for pi, yi in zip(p, y, strict=True) if yi == 0]
    auc = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))
    assert got["auc"] == pytest.approx(auc, rel=1e-12)
    assert got["log_loss"] == pytest.approx(loss, rel=1e-12)
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert got["normalized_entropy"] == pytest.approx(loss / entropy, rel=1e-12)
    assert got["calibration"] == pytest.approx(sum(p) / 40 / rate, rel=1e-12)
    assert got["count"] == 40.0
    probabilities = CTRMetrics(from_logits=False)
    probabilities.update(torch.tensor(p, dtype=torch.float64), labels)
    assert probabilities.compute() == pytest.approx(got, rel=1e-12)


def test_ctr_metrics_refuse_nan_bad_labels_and_no_samples() -> None:
    ctr = CTRMetrics()
    with pytest.raises(ValueError, match=r"CTRMetrics.update: 1 of 2 logits are NaN"):
        ctr.update(torch.tensor([0.0, math.nan]), torch.tensor([0, 1]))
    with pytest.raises(MetricError, match=r"labels must be 0 or 1, got \[2.0\]"):
        ctr.update(torch.tensor([0.0, 1.0]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"probabilities must lie in \[0, 1\]"):
        CTRMetrics(from_logits=False).update(torch.tensor([1.5]), torch.tensor([1]))
    with pytest.raises(MetricError, match="no sample was added on any rank"):
        ctr.compute()


def test_auc_and_log_loss_return_together_with_namespaced_counts() -> None:
    logits, labels = _pairs()
    auc, log_loss = AUC(), LogLoss()
    auc.update(logits, labels)
    log_loss.update(logits, labels)
    values = compute_metrics({"auc": auc, "ll": log_loss}, None)  # type: ignore[arg-type]
    assert sorted(values) == ["auc", "auc/count", "ll/count", "log_loss", "normalized_entropy"]
    assert values["auc"] == auc.compute()["auc"]
    assert values["log_loss"] == log_loss.compute()["log_loss"]
    assert values["auc/count"] == values["ll/count"] == 40.0
    alone = compute_metrics({"auc": auc}, None)  # type: ignore[arg-type]
    assert sorted(alone) == ["auc", "count"]  # one object: its names unchanged


def test_ctr_metrics_are_bit_equal_whatever_the_order_of_the_samples() -> None:
    """The same samples in another order (another split over ranks: validation gathers rank 0's
    samples first, one-process scoring reads them in file order) give the same bits: float64
    sums in arrival order would differ in the last bit for about half of the permutations."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4096, generator=g, dtype=torch.float64)
    labels = (torch.rand(4096, generator=g) < 0.3).long()
    labels[:4] = torch.tensor([0, 1, 0, 1])
    logits[:4] = 0.25  # ties between a positive and a negative: their order matters too
    by_rank = torch.cat([torch.arange(0, 4096, 2), torch.arange(1, 4096, 2)])
    assert float(logits.sum()) != float(logits[by_rank].sum())  # arrival order would show
    in_order, split = CTRMetrics(), CTRMetrics()
    in_order.update(logits, labels)
    split.update(logits[by_rank][:2048], labels[by_rank][:2048])
    split.update(logits[by_rank][2048:], labels[by_rank][2048:])
    assert in_order.compute() == split.compute()
