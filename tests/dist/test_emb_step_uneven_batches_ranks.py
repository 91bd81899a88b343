"""Uneven batches under normalize_by="world_size" (reliability row 75): each rank's loss counts
the same, so a smaller batch's samples weigh more; rank 0 says so once, naming every rank's
batch, and says nothing for even batches or under "global_samples"."""

from __future__ import annotations

import warnings

import torch

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    SparseFeatures,
    row_wise,
    shard_embeddings,
)
from manualpar.testing import run_distributed


def _three_steps(normalize_by: str, batches: list[int]) -> list[str]:
    strategy = mp.ManualParallelStrategy()
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", 16, 4)], seed=2)
    emb = shard_embeddings(ebc, strategy, {"t": row_wise()}, SGD(lr=0.1), normalize_by=normalize_by)
    batch = batches[strategy.rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            ids = torch.arange(batch) % 16 + step
            features = SparseFeatures(["t"], ids % 16, torch.ones(batch, dtype=torch.long))
            emb(features).values.sum().backward()
    strategy.teardown()
    return [str(w.message) for w in caught if "batches differ" in str(w.message)]


def test_uneven_batches_under_world_size_are_named_once_on_rank_0() -> None:
    said = run_distributed(_three_steps, 2, args=("world_size", [6, 2]), timeout=60)
    assert said == [
        [
            "shard_embeddings: the ranks' batches differ (rank 0: 6, rank 1: 2) under "
            "normalize_by='world_size': every rank's loss counts the same, so a sample of a "
            "smaller batch weighs more (here up to 3x). Pass normalize_by='global_samples' (to "
            "shard_embeddings and ddp) to weigh every sample the same, or keep batches even; "
            "said once"
        ],
        [],
    ]


def test_even_batches_or_global_samples_say_nothing() -> None:
    assert run_distributed(_three_steps, 2, args=("world_size", [4, 4]), timeout=60) == [[], []]
    assert run_distributed(_three_steps, 2, args=("global_samples", [6, 2]), timeout=60) == [
        [],
        [],
    ]
