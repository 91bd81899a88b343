"""Scoring jobs: a model with a sharded table and a DDP head scored by Trainer.predict, beside
the logits its validation_step sees on the same batches, on any world size."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    SparseFeatures,
    shard_embeddings,
    table_wise,
)

SAMPLES = 11  # global batches of 4: 4, 4, 3 (uneven over 2 ranks in the last one)
BATCH = 4


class Head(nn.Module):
    """A linear head as an elementwise product and a row sum: each sample's bits do not depend
    on how many samples share its batch (a matrix product's blocking may)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)
        self.weight = nn.Parameter(torch.linspace(-1, 1, width))
        self.bias = nn.Parameter(torch.tensor(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.dropout(x) * self.weight).sum(-1) + self.bias


class Scorer(mp.ParallelModule):
    """Logits from a table (whole on rank 0: its pooling adds in the same order on any world
    size) and a linear head, with dropout (off in eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection([EmbeddingBagConfig("ids", 50, 4)], seed=1)
        self.head = Head(6)
        self.seen: list[torch.Tensor] = []  # the logits validation_step computed

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        plan = EmbeddingPlan(strategy.world_size, {"ids": table_wise(0)})
        self.sparse = shard_embeddings(self.sparse, strategy, plan, SGD(lr=0.1))
        self.head = mp.ddp(self.head, strategy)

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        features = SparseFeatures(["ids"], batch["ids"].reshape(-1), batch["lengths"])
        pooled = self.sparse(features).values
        return self.head(torch.cat([pooled, batch["dense"]], dim=1))

    def predict_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.logits(batch)

    def validation_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        logits = self.logits(batch)
        self.seen.append(logits.clone())
        return {"mean_logit": float(logits.mean())}


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "ids": torch.randint(0, 50, (2,), generator=generator),
            "lengths": torch.tensor(2),
            "dense": torch.randn(2, generator=generator),
        }
        for _ in range(SAMPLES)
    ]


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {
        "ids": torch.stack([s["ids"] for s in samples]),
        "lengths": torch.stack([s["lengths"] for s in samples]),
        "dense": torch.stack([s["dense"] for s in samples]),
    }


def score(out_dir: str) -> dict[str, Any]:
    """This rank's view: every batch's gathered scores, the logits validation saw here, the
    model's mode after, and what the pass reported."""
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(0)
    model = Scorer()
    trainer = mp.Trainer(strategy, out_dir, max_steps=1, val_steps=3, progress=False)
    data = mp.scoring_batches(dataset(), BATCH, collate=collate)
    model.setup(strategy)
    model.train()
    predictions = trainer.predict(model, data)
    scores = list(predictions)
    trainer.validate(model, data)
    out = {
        "scores": scores,
        "seen": model.seen,
        "training": model.training,
        "batches": predictions.batches,
        "ran_out": predictions.ran_out,
        "rank": strategy.rank,
    }
    del trainer, model  # DDP goes before its process group
    strategy.teardown()
    return out
