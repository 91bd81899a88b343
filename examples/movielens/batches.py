"""Step-addressed batches for the Trainer (`data(index, strategy)`), and the popularity baseline.

Training batches are shuffled windows (protocol.training_windows) or prefix samples
(protocol.prefix_samples, RecBole's recipe), each rank taking its share of the global batch.
Evaluation gives every rank the same number of batches, the last ones possibly short or empty,
so that every user is ranked once: the Trainer ends a validation pass at the first batch some
rank lacks, which would otherwise drop the other ranks' last users.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from model import Histories
from protocol import MAX_HISTORY, Targets

import manualpar as mp
from manualpar.metrics import RankingMetrics

Data = Callable[[int, Any], Histories]


def training_batches(windows: torch.Tensor, global_batch: int, seed: int) -> Data:
    """Shuffled each epoch from `seed`; a window's items 1.. are the targets of those before."""

    def collate(rows: list[torch.Tensor]) -> Histories:
        stacked = torch.stack(rows)
        return Histories(items=stacked[:, :-1], targets=stacked[:, 1:])

    return mp.dataset_batches(windows, global_batch, seed=seed, collate=collate)


def prefix_batches(samples: torch.Tensor, global_batch: int, seed: int) -> Data:
    """RecBole's recipe (protocol.prefix_samples), shuffled each epoch from `seed`: each
    sample's one target sits at its history's last position, the other positions have none,
    so SASRec's loss is RecBole's (cross-entropy at the last item only, mean over samples)."""

    def collate(rows: list[torch.Tensor]) -> Histories:
        stacked = torch.stack(rows)
        items = stacked[:, :MAX_HISTORY]
        targets = torch.full_like(items, -1)
        last = (items >= 0).sum(1) - 1
        targets[torch.arange(len(items)), last] = stacked[:, MAX_HISTORY]
        return Histories(items=items, targets=targets)

    return mp.dataset_batches(samples, global_batch, seed=seed, collate=collate)


def evaluation_batches(users: Targets, per_rank: int) -> tuple[Data, Callable[[int], int]]:
    """(data, batches(world_size)): rank r ranks users r, r + world, ... in batches of
    `per_rank`; every rank has batches(world_size) batches."""

    def batches(world: int) -> int:
        most = -(-len(users) // world)
        return max(1, -(-most // per_rank))

    def data(index: int, strategy: Any) -> Histories:
        if index >= batches(strategy.world_size):
            raise StopIteration
        mine = torch.arange(strategy.rank, len(users), strategy.world_size)
        chunk = mine[index * per_rank : (index + 1) * per_rank]
        return Histories(items=users.histories[chunk], target=users.targets[chunk])

    return data, batches


def popularity_ranks(train: list[list[int]], num_items: int, users: Targets) -> torch.Tensor:
    """Every user ranked by how often each item was a training item (ties: smaller id first)."""
    counts = torch.zeros(num_items, dtype=torch.int64)
    for items in train:
        counts += torch.bincount(torch.tensor(items, dtype=torch.int64), minlength=num_items)
    target = counts[users.targets]
    ids = torch.arange(num_items)
    higher = (counts.unsqueeze(0) > target.unsqueeze(1)).sum(1)
    tied_before = (counts.unsqueeze(0) == target.unsqueeze(1)) & (ids < users.targets[:, None])
    return 1 + higher + tied_before.sum(1)


def popularity_metrics(train: list[list[int]], num_items: int, users: Targets) -> dict[str, float]:
    metrics = RankingMetrics(ks=(10, 20))
    metrics.update(popularity_ranks(train, num_items, users))
    return metrics.compute(None)
