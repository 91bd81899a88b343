"""DCN-v2: sharded embedding tables (one on disk), a DDP bottom MLP, an FSDP cross network and
top MLP, and the click-model metrics.

The input of the cross network is x_0 = [bottom(dense), e_1, ..., e_26], the bottom MLP's output
beside the 26 pooled embeddings (all of width `dim`); the cross layers (`mp.nn.CrossNet`) model
the explicit feature crosses, and the top MLP turns their output into a logit (the "stacked"
DCN-v2). Declared on the meta device, nothing is allocated until `setup(strategy)`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import manualpar as mp
from manualpar.data import CriteoBatch
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    row_wise,
    shard_embeddings,
)
from manualpar.metrics import CTRMetrics


def mlp(sizes: Sequence[int], *, last_relu: bool) -> nn.Sequential:
    """Linear layers with ReLUs between them (and after the last when `last_relu`)."""
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        if last_relu or index < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DeepCross(nn.Module):
    """The cross network, then the top MLP: one FSDP unit each."""

    def __init__(self, width: int, layers: int, rank: int | None, top: Sequence[int]) -> None:
        super().__init__()
        self.cross = mp.nn.CrossNet(width, layers, rank=rank)
        self.top = mlp([width, *top, 1], last_relu=False)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        return self.top(self.cross(x0))


class DCN(mp.ParallelModule):
    """Click-through-rate model of DCN-v2's shape (Wang et al., 2021) on Criteo's features."""

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        *,
        tier_dir: str | Path,
        disk_table: str = "cat_2",
        cache_rows: int = 4096,
        num_dense: int = 13,
        bottom: Sequence[int] = (64,),
        cross_layers: int = 2,
        cross_rank: int | None = None,
        top: Sequence[int] = (128, 64),
        emb_lr: float = 0.05,
        lr: float = 1e-3,
        seed: int = 0,
        wire_dtype: str = "fp32",
    ) -> None:
        super().__init__()
        self.wire_dtype = wire_dtype  # the exchanges' dtype by its short name, e.g. "bf16"
        self.dim = tables[0].embedding_dim
        if any(t.embedding_dim != self.dim for t in tables):
            raise ValueError("DCN needs one embedding_dim for all tables")
        self.tables, self.disk_table = tuple(tables), disk_table
        self.tier = DiskTier(tier_dir, cache_rows=cache_rows)
        self.emb_lr, self.lr, self.seed = emb_lr, lr, seed
        # (sharded and wrapped in setup)
        self.embeddings: EmbeddingBagCollection | ShardedEmbeddingBagCollection = (
            EmbeddingBagCollection(tables, seed=seed)
        )
        self.bottom: nn.Module = mlp([num_dense, *bottom, self.dim], last_relu=True)
        self.head: nn.Module = DeepCross(
            (len(tables) + 1) * self.dim, cross_layers, cross_rank, top
        )
        self.ctr = CTRMetrics()  # validation: AUC, log loss, NE, calibration over every rank

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        assert isinstance(self.embeddings, EmbeddingBagCollection)  # (setup runs once)
        self.embeddings = shard_embeddings(
            self.embeddings,
            strategy,
            plan="auto",  # the planner places the other 25 tables around the pinned one
            pinned={self.disk_table: row_wise(on_disk=True)},  # rows split over every rank
            rule=RowWiseAdagrad(lr=self.emb_lr),
            disk_tier=self.tier,
            wire_dtype=self.wire_dtype,
        )
        self.head = mp.fsdp(self.head, strategy, wrap=(mp.nn.CrossNet,))  # this rank's shards
        mp.materialize(self, strategy, seed=self.seed)  # the bottom MLP, equal on every rank
        self.bottom = mp.ddp(self.bottom, strategy)

    def prefetch(self, batch: CriteoBatch) -> None:
        """The next batch's ids travel (and its disk rows are read) during this step."""
        assert isinstance(self.embeddings, ShardedEmbeddingBagCollection)  # (after setup)
        self.embeddings.prefetch(batch.sparse)

    def forward(self, batch: CriteoBatch) -> torch.Tensor:
        """Logits (B,)."""
        device = self.strategy.device if self.strategy is not None else torch.device("cpu")
        pooled = self.embeddings(batch.sparse).values  # (B, 26 * dim)
        x0 = torch.cat([self.bottom(batch.dense.to(device)), pooled], dim=1)
        return self.head(x0).reshape(-1)

    def training_step(self, batch: CriteoBatch, step: int) -> dict[str, torch.Tensor]:
        logits = self(batch)
        return {"loss": F.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.device))}

    def validation_step(self, batch: CriteoBatch) -> dict[str, CTRMetrics]:
        self.ctr.update(self(batch), batch.labels)
        return {"ctr": self.ctr}

    def predict_step(self, batch: CriteoBatch) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=self.lr)
