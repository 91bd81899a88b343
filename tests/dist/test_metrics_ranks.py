"""Metrics over 1, 2 and 3 ranks holding different numbers of samples (one rank none) equal the
metric of all samples in one process, the same dict on every rank; a one-class AUC fails on
every rank."""

from __future__ import annotations

import pytest
import torch

import manualpar as mp
from manualpar.metrics import AUC, CTRMetrics, LogLoss, RankingMetrics
from manualpar.testing import run_distributed

COUNTS = {1: [7], 2: [0, 9], 3: [5, 0, 12]}


def _samples(world: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    n = COUNTS[world][rank]
    return {
        "ranks": torch.randint(1, 25, (n,), generator=g),
        "scores": torch.randint(0, 5, (n,), generator=g) / 4,  # ties across ranks
        "labels": torch.arange(n) % 2 if rank != 2 else torch.ones(n, dtype=torch.int64),
        "logits": torch.randn(n, generator=g),
    }


def _update(metrics: dict, samples: dict[str, torch.Tensor]) -> dict:
    metrics["ranking"].update(samples["ranks"])
    metrics["auc"].update(samples["scores"], samples["labels"])
    metrics["log_loss"].update(samples["logits"], samples["labels"])
    metrics["ctr"].update(samples["logits"], samples["labels"])
    return metrics


def _metrics() -> dict:
    return {
        "ranking": RankingMetrics(ks=(1, 5, 10)),
        "auc": AUC(),
        "log_loss": LogLoss(),
        "ctr": CTRMetrics(),
    }


def _rank(world: int) -> dict:
    strategy = mp.ManualParallelStrategy()
    metrics = _update(_metrics(), _samples(world, strategy.rank))
    result = {name: metric.compute(strategy) for name, metric in metrics.items()}
    one_class = AUC()
    one_class.update(torch.tensor([0.5] * strategy.rank), torch.ones(strategy.rank))
    try:
        one_class.compute(strategy)
    except ValueError as error:
        result["one_class"] = str(error)
    strategy.teardown()
    return result


@pytest.mark.parametrize("world", [1, 2, 3])
def test_metrics_over_uneven_ranks_equal_the_metrics_of_all_samples(world: int) -> None:
    results = run_distributed(_rank, world, args=(world,), timeout=60)
    parts = [_samples(world, rank) for rank in range(world)]
    everything = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    expected = {n: m.compute() for n, m in _update(_metrics(), everything).items()}
    for result in results:
        assert result == results[0]  # the same dict on every rank, bit for bit
    for name, values in expected.items():
        assert results[0][name] == pytest.approx(values, rel=1e-12, abs=1e-15), name
    assert results[0]["ranking"]["count"] == sum(COUNTS[world])
    assert results[0]["one_class"] == (
        f"AUC: needs both classes, got {sum(range(world))} positive and 0 negative samples over "
        "all ranks; AUC is undefined with one class (evaluate on more samples)"
    )
