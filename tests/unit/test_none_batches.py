"""A batch of None is refused on one process: the loop reads None as "no batch", so a data
function or loader that gives one would otherwise stop the loop early or fail later, far from
its cause (tests/dist/test_trainer.py and test_emb_pipeline_ranks.py: the same on 2 ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import manualpar as mp
from manualpar.errors import DataError


class _Regression(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, step: int) -> torch.Tensor:
        return self.fc(batch).pow(2).mean()

    def validation_step(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.fc(batch).pow(2).mean()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _none_at(where: int):  # type: ignore[no-untyped-def]
    def data(index: int, strategy: mp.ManualParallelStrategy) -> torch.Tensor | None:
        return None if index == where else torch.full((4, 2), float(index))

    return data


def test_the_trainer_refuses_a_batch_of_none_naming_the_rank_and_batch(tmp_path: Path) -> None:
    trainer = mp.Trainer(
        mp.ManualParallelStrategy(), tmp_path, max_steps=6, accumulate=2, progress=False
    )
    with pytest.raises(DataError) as caught:
        trainer.fit(_Regression(), _none_at(5))  # step 2's second micro-batch
    assert str(caught.value) == (
        "data returned None for batch 5 on rank 0; every rank raises this at the same step. "
        "A batch must not be None, which means 'no batch' to the loop: return the batch, or "
        "raise StopIteration when this rank's data has ended (every rank then stops there)"
    )
    assert trainer.step == 2  # steps 0 and 1 were taken, step 2 never started


def test_validation_refuses_a_batch_of_none(tmp_path: Path) -> None:
    trainer = mp.Trainer(
        mp.ManualParallelStrategy(), tmp_path, max_steps=2, val_every=1, val_steps=3,
        progress=False,
    )  # fmt: skip
    with pytest.raises(DataError, match=r"^val_data returned None for batch 2 on rank 0; "):
        trainer.fit(_Regression(), _none_at(-1), val_data=_none_at(2))


def test_train_pipeline_refuses_a_batch_of_none_after_the_batches_before_it() -> None:
    sent: list[int] = []
    pipeline = mp.TrainPipeline([0, 1, None, 3], mp.ManualParallelStrategy(), sent.append)
    handed = []
    with pytest.raises(DataError) as caught:
        for batch in pipeline:
            handed.append(batch)
    assert handed == [0, 1] and sent == [0, 1]  # None was never prefetched
    assert str(caught.value) == (
        "TrainPipeline: the loader of rank 0 yielded None as batch 2 (after 2 batches handed "
        "out); every rank raises this after the same batch. A loader must not yield None, "
        "which means 'no next batch' to the pipeline: yield the batch, or end the iterator "
        "when this rank's data has ended (every rank then stops after the same batch)"
    )
