"""Scoring in one process: Trainer.predict yields each batch's outputs in input order, in eval
mode, equal to what validation_step computes; scoring_batches splits every sample once; bad
models and outputs are named."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import manualpar as mp


class Net(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Dropout(0.5), nn.Linear(3, 2))
        self.seen: list[torch.Tensor] = []

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.net(batch[0])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        self.seen.append(self.net(batch[0]))
        return {"n": float(len(batch[0]))}


DATASET = [(torch.full((3,), float(i)), torch.tensor(i)) for i in range(10)]


def test_scores_come_in_input_order_in_eval_mode_like_validation(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    trainer = mp.Trainer(strategy, tmp_path, max_steps=1, val_steps=5, progress=False)
    model = Net()
    data = mp.scoring_batches(DATASET, 4)
    predictions = trainer.predict(model, data)
    scores = list(predictions)
    assert [len(s) for s in scores] == [4, 4, 2] and predictions.batches == 3
    assert model.training  # put back after the pass
    with torch.no_grad():  # in input order, dropout off (a matmul's bits may vary by batch)
        whole = model.net.eval()(torch.stack([x for x, _ in DATASET]))
    torch.testing.assert_close(torch.cat(scores), whole, rtol=1e-6, atol=1e-6)
    model.train()
    trainer.validate(model, data)
    assert torch.equal(torch.cat(model.seen), torch.cat(scores))
    assert [len(s) for s in trainer.predict(model, data, steps=2)] == [4, 4]


def test_scoring_batches_give_every_rank_a_sample_of_every_batch() -> None:
    data = mp.scoring_batches(list(range(9)), 4, collate=list)
    ranks = [SimpleNamespace(rank=r, world_size=2) for r in range(2)]
    # 9 = 4 + 4 + 1: the last sample joins the batch before it, so rank 1 never runs out
    assert [data(i, ranks[0]) for i in range(2)] == [[0, 2], [4, 6, 8]]
    assert [data(i, ranks[1]) for i in range(2)] == [[1, 3], [5, 7]]
    with pytest.raises(StopIteration):
        data(2, ranks[0])
    with pytest.raises(mp.DataError, match="cannot give each of 2 ranks a sample"):
        mp.scoring_batches([0], 4, collate=list)(0, ranks[0])


def test_a_model_without_predict_step_or_with_a_bad_output(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    data = mp.scoring_batches(DATASET, 4)
    with pytest.raises(
        mp.ConfigTypeError, match=re.escape("predict: Linear has no predict_step(batch)")
    ):
        mp.predict(nn.Linear(3, 1), data, strategy)
    model = Net()
    model.predict_step = lambda batch: {"logits": batch[0]}  # type: ignore[method-assign]
    with pytest.raises(mp.ConfigTypeError, match=re.escape("predict_step returned {'logits'")):
        list(mp.predict(model, data, strategy))
    with pytest.raises(mp.ConfigError, match=re.escape("order must be one of ('interleaved', ")):
        mp.predict(Net(), data, strategy, order="sorted")
