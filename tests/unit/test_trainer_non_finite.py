"""The Trainer and non_finite="skip" (reliability row 76): a step whose loss is NaN leaves the
sharded tables and the dense parameters as they were, is logged as skipped, and training goes
on."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import manualpar as mp
from manualpar.embeddings import SGD, SparseFeatures, full_tensors, shard_embeddings

NAN_STEP = 1


class _Tower(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = mp.EmbeddingBagCollection([mp.EmbeddingBagConfig("t", 8, 2)], seed=1)
        self.fc = nn.Linear(2, 1)
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.emb = shard_embeddings(self.emb, strategy, "auto", SGD(lr=0.1), non_finite="skip")

    def training_step(self, batch: SparseFeatures, step: int) -> torch.Tensor:
        with full_tensors():
            table = self.emb.state_dict()["tables.t.weight"].clone()
        self.snapshots.append((table, self.fc.weight.detach().clone()))
        loss = self.fc(self.emb(batch).values).square().mean()
        return loss * float("nan") if step == NAN_STEP else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.dense_parameters(), lr=0.1)


def _batch(step: int, strategy: mp.ManualParallelStrategy) -> SparseFeatures:
    return SparseFeatures.from_dict({"t": [[step % 8], [(step + 3) % 8, 5]]})


def test_a_skipped_sparse_update_skips_the_dense_step_too(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    model = _Tower()
    model.setup(strategy)
    trainer = mp.Trainer(strategy, tmp_path, max_steps=3, progress=False, log_every=1)
    trainer.fit(model, _batch)
    (t0, w0), (t1, w1), (t2, w2) = model.snapshots
    assert not torch.equal(t1, t0) and not torch.equal(w1, w0)  # step 0 trained
    assert torch.equal(t2, t1) and torch.equal(w2, w1)  # the NaN step changed nothing
    assert model.emb.skipped_updates == 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if r.get("skipped_non_finite")]
    assert skipped == [NAN_STEP + 1]  # logged with the step count after it
