"""Trainer on one process: argument checks, and dataset_batches' split of each epoch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import manualpar as mp


def _no_batches(step: int, strategy: mp.ManualParallelStrategy) -> None:
    raise AssertionError("the Trainer asked for a batch before checking the model")


def test_bad_arguments() -> None:
    strategy = mp.ManualParallelStrategy()
    with pytest.raises(ValueError, match="Trainer: accumulate must be >= 1, got 0"):
        mp.Trainer(strategy, "x", max_steps=1, accumulate=0)
    with pytest.raises(TypeError, match=r"Linear has no configure_optimizers\(\)"):
        mp.Trainer(strategy, "x", max_steps=1).fit(nn.Linear(1, 1), _no_batches)


class _Ranked:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def test_dataset_batches_cover_each_epoch_once_across_ranks() -> None:
    dataset = torch.arange(24).float()
    data = mp.dataset_batches(dataset, global_batch_size=6, seed=3)
    ranks = [_Ranked(r, 2) for r in range(2)]
    epoch = [data(step, rank) for step in range(4) for rank in ranks]  # 24 // 6 = 4 steps/epoch
    assert all(len(b) == 3 for b in epoch)
    assert sorted(torch.cat(epoch).tolist()) == list(range(24))
    assert torch.equal(mp.dataset_batches(dataset, 6, seed=3)(5, ranks[1]), data(5, ranks[1]))
    assert not torch.equal(data(4, ranks[0]), epoch[0])  # reshuffled next epoch
    with pytest.raises(ValueError, match="global_batch_size 5 is not a multiple of the world"):
        mp.dataset_batches(dataset, 5)(0, ranks[0])
    with pytest.raises(ValueError, match=r"global_batch_size 30 must be in \[1, len\(dataset\)"):
        mp.dataset_batches(dataset, 30)


class _Regression(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, step: int) -> torch.Tensor:
        return self.fc(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_val_every_without_val_data_warns(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trainer = mp.Trainer(
        mp.ManualParallelStrategy(), tmp_path, max_steps=2, val_every=1, progress=False
    )
    with pytest.warns(UserWarning, match=r"Trainer\(val_every=1\) but fit\(\) got no val_data"):
        trainer.fit(_Regression(), lambda step, strategy: torch.ones(4, 2))
    assert trainer.step == 2


def test_fit_on_a_finished_run_returns_its_last_metrics(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def data(step: int, strategy: mp.ManualParallelStrategy) -> torch.Tensor:
        return torch.full((4, 2), float(step + 1))

    def fit() -> dict[str, float]:
        torch.manual_seed(0)
        trainer = mp.Trainer(mp.ManualParallelStrategy(), tmp_path, max_steps=3, progress=False)
        return trainer.fit(_Regression(), data)

    first = fit()
    assert set(first) == {"loss"}
    again = fit()  # resumes at step 3 = max_steps: nothing to train
    assert again == first
