"""The recommender example's data and metric: samples depend only on seed and index, the
Criteo TSV reader parses exact values, and its AUC equals the brute-force pair count."""

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


def test_criteo_tsv_reader_parses_exact_values(tmp_path: Path) -> None:
    rows = [10] * data.NUM_SPARSE
    rows[1] = 1  # a one-row table: every value, present or not, is row 0
    counts = [[5, None, -2, 0, *range(9)], [None] * data.NUM_DENSE, [7] * data.NUM_DENSE]
    cats = [
        ["68fd1e64", "80e26c9b", None, *["0000000a"] * 23],
        [None] * data.NUM_SPARSE,
        ["ffffffff"] * data.NUM_SPARSE,
    ]
    path = tmp_path / "day.tsv"
    data.write_criteo_tsv(path, zip([1, 0, 1], counts, cats, strict=True))
    assert path.read_text().splitlines()[1] == "0" + "\t" * 39
    single = SimpleNamespace(rank=0, world_size=1)
    source = data.CriteoTSV(path, rows, single, batch_size=1, val_samples=1)
    batch = source.train(0, single)
    assert batch.labels.tolist() == [1.0]
    expected = torch.tensor([math.log(6), 0, 0, 0, *(math.log1p(i) for i in range(9))])
    torch.testing.assert_close(batch.dense[0], expected.float())
    ids = batch.sparse.values.tolist()  # one id per feature: feature-major is sample order
    assert ids[:3] == [1 + 0x68FD1E64 % 9, 0, 0] and ids[3:] == [1 + 10 % 9] * 23
    assert batch.sparse.lengths.tolist() == [1] * data.NUM_SPARSE
    second = source.train(1, single)
    assert second.labels.tolist() == [0.0] and second.dense.abs().sum() == 0
    assert second.sparse.values.tolist() == [0] * data.NUM_SPARSE
    validation = source.validation(0, single)  # the last line
    assert validation.sparse.values.tolist() == [1 + 0xFFFFFFFF % 9, 0, *[1 + 0xFFFFFFFF % 9] * 24]
    assert source.train(2, single).labels.tolist() == [1.0]  # wraps around: an epoch is 2 lines
    ranks = [
        data.CriteoTSV(
            path, rows, SimpleNamespace(rank=r, world_size=2), batch_size=2, val_samples=0
        )
        for r in range(2)
    ]  # rank r keeps lines r, r + 2, ...
    assert [len(r.labels) for r in ranks] == [1, 1]  # the odd last line is dropped on all ranks
    assert ranks[1].dense[0].tolist() == [0.0] * data.NUM_DENSE


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
