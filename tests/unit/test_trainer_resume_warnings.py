"""A resume with sharded tables raises no warning from the library's own code: every warning is
an error here (a user's `-W error` run must not fail on manualpar's internals)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    SparseFeatures,
    shard_embeddings,
)

TABLES = [EmbeddingBagConfig("t", 8, 2)]


def _batch(step: int, strategy: object = None) -> SparseFeatures:
    generator = torch.Generator().manual_seed(step)
    return SparseFeatures.from_dict(
        {"t": torch.randint(0, 8, (4, 2), generator=generator).tolist()}
    )


class _Model(nn.Module):
    def __init__(self, strategy: mp.ManualParallelStrategy) -> None:
        super().__init__()
        rule = RowWiseAdagrad(lr=0.1)
        self.emb = shard_embeddings(EmbeddingBagCollection(TABLES), strategy, "auto", rule)
        self.head = nn.Linear(2, 1)

    def training_step(self, batch: SparseFeatures, step: int) -> torch.Tensor:
        return self.head(self.emb(batch).values).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def _fit(out_dir: object, max_steps: int) -> None:
    strategy = mp.ManualParallelStrategy()
    trainer = mp.Trainer(strategy, out_dir, max_steps=max_steps, checkpoint_every=2, progress=False)
    trainer.fit(_Model(strategy), _batch)


def test_a_resume_with_tables_warns_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _fit(tmp_path, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit(tmp_path, 4)  # resumes from step 2: restores the fused optimizer's learning rate
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "step_00000004"
