"""The recommender example's data and metric: samples depend only on seed and index, and its AUC
equals the brute-force pair count (the Criteo reader, manualpar.data: test_data_criteo.py)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from example_modules import load_example

data = load_example(Path("recsys/data.py"), "recsys_data")
metrics = load_example(Path("recsys/metrics.py"), "recsys_metrics")


def test_synthetic_samples_depend_only_on_seed_and_index() -> None:
    source = data.SyntheticCriteo(data.table_rows(max_rows=1000), seed=3, batch_size=8)
    whole = source.samples(96, 8)  # global batch 12
    ranks = [source.train(12, SimpleNamespace(rank=r, world_size=2)) for r in range(2)]
    assert torch.equal(torch.cat([b.dense for b in ranks]), whole.dense)
    assert torch.equal(torch.cat([b.labels for b in ranks]), whole.labels)
    ids = whole.sparse.values.view(data.NUM_SPARSE, 8)
    assert torch.equal(torch.cat([b.sparse.values.view(data.NUM_SPARSE, 4) for b in ranks], 1), ids)
    assert bool((ids < torch.tensor(data.table_rows(max_rows=1000)).unsqueeze(1)).all())
    other = data.SyntheticCriteo(data.table_rows(max_rows=1000), seed=4).samples(96, 8)
    assert not torch.equal(other.dense, whole.dense)


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_brute_force_pairs(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 20, (300,), generator=generator).float()  # many ties
    labels = (torch.rand(300, generator=generator) < 0.3).float()
    positives, negatives = scores[labels > 0.5].tolist(), scores[labels < 0.5].tolist()
    pairs = [
        1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(positives, negatives)
    ]
    assert math.isclose(metrics.auc(scores, labels), sum(pairs) / len(pairs), rel_tol=1e-12)
    continuous = torch.randn(300, generator=generator, dtype=torch.float64)
    rank_order = continuous.argsort().argsort().double()  # AUC depends on the order only
    assert metrics.auc(continuous, labels) == metrics.auc(rank_order, labels)
    assert math.isnan(metrics.auc(scores, torch.zeros(300)))


def test_auc_of_perfect_and_reversed_scores() -> None:
    labels = np.array([0, 0, 1, 1, 0, 1])
    scores = torch.tensor(labels, dtype=torch.float32)
    assert metrics.auc(scores, torch.tensor(labels)) == 1.0
    assert metrics.auc(-scores, torch.tensor(labels)) == 0.0
