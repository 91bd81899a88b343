"""The metrics against their plain formulas, written out here: ranking metrics from target
ranks, AUC over every (positive, negative) pair, log loss and normalized entropy, and the tie
rule of target_ranks_from_scores."""

from __future__ import annotations

import math

import pytest
import torch

import manualpar as mp
from manualpar.errors import NonFiniteError
from manualpar.metrics import (
    AUC,
    CTRMetrics,
    LogLoss,
    Metric,
    RankingMetrics,
    is_metric,
    target_ranks_from_scores,
)


def test_ranking_metrics_are_the_means_of_the_per_query_formulas() -> None:
    ranks = torch.randint(1, 40, (53,), generator=torch.Generator().manual_seed(0))
    ranks[:3] = torch.tensor([1, 10, 11])  # the edges of K = 10
    metric = RankingMetrics(ks=(1, 10))
    for part in ranks.split(20):  # several updates
        metric.update(part)
    got = metric.compute()
    for k in (1, 10):
        hits = [float(r <= k) for r in ranks.tolist()]
        assert got[f"hr@{k}"] == pytest.approx(sum(hits) / 53, abs=1e-12)
        assert got[f"recall@{k}"] == got[f"hr@{k}"]
        ndcg = [h / math.log2(r + 1) for h, r in zip(hits, ranks.tolist(), strict=True)]
        assert got[f"ndcg@{k}"] == pytest.approx(sum(ndcg) / 53, abs=1e-12)
        mrr = [h / r for h, r in zip(hits, ranks.tolist(), strict=True)]
        assert got[f"mrr@{k}"] == pytest.approx(sum(mrr) / 53, abs=1e-12)
    assert got["count"] == 53
    # a one-process strategy gives the same dict; reset forgets everything
    assert metric.compute(mp.ManualParallelStrategy()) == got
    metric.reset()
    metric.update(torch.tensor([[2]]))
    assert metric.compute()["mrr@10"] == 0.5


def test_ranking_metrics_refuse_bad_ranks() -> None:
    metric = RankingMetrics()
    with pytest.raises(mp.MetricError, match="ranks are 1-based, got 0 at position 1 of 3"):
        metric.update(torch.tensor([3, 0, 2]))
    with pytest.raises(ValueError, match=r"must be an integer tensor, got torch\.float32"):
        metric.update(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="no query was added on any rank"):
        metric.compute()
    with pytest.raises(ValueError, match="ks holds a K twice"):
        RankingMetrics(ks=(5, 5))


def _pairwise_auc(scores: list[float], labels: list[int]) -> float:
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == 0]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auc_is_the_pairwise_probability_with_ties_counting_half() -> None:
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 6, (80,), generator=g).float() / 2  # many ties
    labels = torch.randint(0, 2, (80,), generator=g)
    metric = AUC()
    metric.update(scores[:30], labels[:30].bool())
    metric.update(scores[30:], labels[30:].float())
    got = metric.compute()
    assert got["auc"] == pytest.approx(_pairwise_auc(scores.tolist(), labels.tolist()), abs=1e-12)
    assert got["count"] == 80
    metric.reset()
    metric.update(torch.tensor([0.3, 0.3, 0.1]), torch.tensor([1, 0, 0]))
    assert metric.compute()["auc"] == 0.75  # (1/2 + 1) / 2


def test_auc_refuses_one_class_and_bad_labels() -> None:
    metric = AUC()
    metric.update(torch.tensor([0.1, 0.9]), torch.tensor([1, 1]))
    with pytest.raises(mp.MetricError, match="needs both classes, got 2 positive and 0 negative"):
        metric.compute()
    with pytest.raises(ValueError, match=r"labels must be 0 or 1, got \[2.0\]"):
        metric.update(torch.tensor([0.5]), torch.tensor([2]))
    with pytest.raises(ValueError, match="2 scores but 1 labels"):
        metric.update(torch.tensor([0.5, 0.2]), torch.tensor([1]))


def test_log_loss_and_normalized_entropy_follow_their_formulas() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(37, generator=g) * 3
    labels = torch.randint(0, 2, (37,), generator=g)
    metric = LogLoss()
    metric.update(logits[:10], labels[:10])
    metric.update(logits[10:], labels[10:])
    got = metric.compute()
    p = [1 / (1 + math.exp(-x)) for x in logits.tolist()]
    terms = [
        -(y * math.log(q) + (1 - y) * math.log(1 - q))
        for q, y in zip(p, labels.tolist(), strict=True)
    ]
    expected = sum(terms) / 37
    rate = sum(labels.tolist()) / 37
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert got["log_loss"] == pytest.approx(expected, rel=1e-12)
    assert got["normalized_entropy"] == pytest.approx(expected / entropy, rel=1e-12)
    assert got["count"] == 37
    from_probabilities = LogLoss(from_logits=False)
    from_probabilities.update(torch.sigmoid(logits.double()), labels)
    assert from_probabilities.compute()["log_loss"] == pytest.approx(expected, rel=1e-9)
    one_class = LogLoss()
    one_class.update(torch.tensor([0.0]), torch.tensor([1]))
    assert math.isnan(one_class.compute()["normalized_entropy"])
    with pytest.raises(mp.MetricError, match="probabilities must lie in"):
        from_probabilities.update(torch.tensor([1.5]), torch.tensor([1]))


def test_every_metric_follows_the_protocol() -> None:
    for metric in (RankingMetrics(), AUC(), LogLoss()):
        assert is_metric(metric) and isinstance(metric, Metric)
    assert not is_metric(torch.nn.Linear(1, 1))
    assert mp.metrics.RankingMetrics is RankingMetrics and "metrics" in mp.__all__


def _reference_ranks(scores: torch.Tensor, targets: torch.Tensor) -> list[int]:
    ranks = []
    for row, target in zip(scores.tolist(), targets.tolist(), strict=True):
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))
        ranks.append(order.index(target) + 1)
    return ranks


def test_target_ranks_break_ties_by_the_smaller_id() -> None:
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (9, 12), generator=g).float()  # many ties
    scores[0, 5] = float("-inf")
    targets = torch.randint(0, 12, (9,), generator=g)
    targets[0] = 5
    got = target_ranks_from_scores(scores, targets)
    reference = _reference_ranks(scores, targets)
    assert got.tolist() == reference and got.dtype == torch.int64
    assert target_ranks_from_scores(torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([2])).item() == 3
    with pytest.raises(
        mp.MetricError, match=r"target 12 of query 0 is not an item id in \[0, 12\)"
    ):
        target_ranks_from_scores(scores[:1], torch.tensor([12]))


def test_nan_scores_are_refused_by_every_metric() -> None:
    """A diverged model's all-NaN scores once ranked by item id (hr@10 0.31 with popular items
    first): each metric now refuses NaN with the same NonFiniteError (a ValueError)."""
    diverged = torch.full((3, 12), float("nan"))
    with pytest.raises(NonFiniteError, match=r"^target_ranks_from_scores: 36 of 36 scores are"):
        target_ranks_from_scores(diverged, torch.tensor([0, 1, 2]))
    one = torch.zeros(2, 5)
    one[1, 3] = float("nan")
    with pytest.raises(
        NonFiniteError,
        match=r"^target_ranks_from_scores: 1 of 10 scores are NaN, the first in query 1 "
        r"\(a diverged model\?\); check the model's outputs before scoring them$",
    ):
        target_ranks_from_scores(one, torch.tensor([0, 0]))
    with pytest.raises(NonFiniteError, match=r"^AUC.update: 1 of 2 scores are NaN \(a diverged"):
        AUC().update(torch.tensor([0.5, math.nan]), torch.tensor([0, 1]))
    with pytest.raises(NonFiniteError, match=r"^LogLoss.update: 2 of 3 logits are NaN \(a div"):
        LogLoss().update(torch.tensor([math.nan, 0.0, math.nan]), torch.tensor([0, 1, 1]))
    with pytest.raises(NonFiniteError, match=r"^LogLoss.update: 1 of 1 probabilities are NaN"):
        LogLoss(from_logits=False).update(torch.tensor([math.nan]), torch.tensor([1]))
    with pytest.raises(NonFiniteError, match=r"^CTRMetrics.update: 1 of 2 logits are NaN"):
        CTRMetrics().update(torch.tensor([0.0, math.nan]), torch.tensor([0, 1]))


def test_infinite_logits_count_at_their_limit() -> None:
    """+inf with label 1 and -inf with label 0 cost 0 (the limit of the loss); an infinite logit
    against its label costs inf (torch's formula gives NaN for the first two)."""
    inf = math.inf
    logits, labels = torch.tensor([inf, -inf, 0.0, 2.0]), torch.tensor([1, 0, 1, 0])
    finite = (math.log(2) + math.log(1 + math.exp(2.0))) / 4
    for metric in (LogLoss(), CTRMetrics()):
        metric.update(logits, labels)
        assert metric.compute()["log_loss"] == pytest.approx(finite, rel=1e-12)
    wrong = LogLoss()
    wrong.update(torch.tensor([inf, 0.0]), torch.tensor([0.5, 1.0]))  # a soft label too
    assert wrong.compute()["log_loss"] == inf
    ctr = CTRMetrics()
    ctr.update(torch.tensor([-inf, 1.0]), torch.tensor([1, 0]))
    assert ctr.compute()["log_loss"] == inf
