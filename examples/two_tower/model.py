"""Two-tower retrieval: a user tower and an item tower scored by a dot product, trained with a
softmax over in-batch negatives from every rank.

- user tower: row-wise sharded tables (user_id, user_segment) + an MLP sharded with `fsdp`;
- item tower: tables placed by the planner (item_id, item_category) + an MLP replicated with
  `ddp`;
- each rank scores its own users against the items of the whole global batch, gathered with
  `strategy.all_gather(..., differentiable=True)`, so every rank's items are negatives for every
  user and their gradients flow back to the rank that embedded them;
- one dense optimizer with a cosine schedule, the tables' fused optimizers with their own
  schedules, gradient clipping across the fsdp and ddp parts (`Trainer(clip_grad_norm=...)`);
- `freeze_tables=True` (fine-tuning) stops the tables' fused updates and trains the MLPs only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from data import Pairs
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    SparseFeatures,
    row_wise,
    shard_embeddings,
)

Tables = EmbeddingBagCollection | ShardedEmbeddingBagCollection  # before and after setup


def tower_mlp(dim: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))


class TwoTower(mp.ParallelModule):
    def __init__(
        self,
        *,
        users: int,
        items: int,
        clusters: int,
        dim: int = 16,
        hidden: int = 64,
        temperature: float = 0.1,
        lr: float = 3e-3,
        emb_lr: float = 0.1,
        steps: int = 200,
        freeze_tables: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.temperature, self.lr, self.emb_lr, self.steps = temperature, lr, emb_lr, steps
        self.items, self.clusters = items, clusters
        self.freeze_tables, self.seed = freeze_tables, seed
        # (sharded and wrapped in setup)
        self.user_tables: Tables = EmbeddingBagCollection(
            [
                EmbeddingBagConfig("user_id", users, dim),
                EmbeddingBagConfig("user_segment", clusters, dim),
            ],
            seed=seed,
        )
        self.item_tables: Tables = EmbeddingBagCollection(
            [
                EmbeddingBagConfig("item_id", items, dim),
                EmbeddingBagConfig("item_category", clusters, dim),
            ],
            seed=seed + 1,
        )
        self.user_mlp: nn.Module = tower_mlp(dim, hidden)
        self.item_mlp: nn.Module = tower_mlp(dim, hidden)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        user_plan = {name: row_wise() for name in ("user_id", "user_segment")}
        users, items = self.user_tables, self.item_tables
        assert isinstance(users, EmbeddingBagCollection)  # (setup runs once)
        assert isinstance(items, EmbeddingBagCollection)
        self.user_tables = shard_embeddings(
            users, strategy, plan=user_plan, rule=RowWiseAdagrad(lr=self.emb_lr)
        )
        self.item_tables = shard_embeddings(
            items, strategy, plan="auto", rule=RowWiseAdagrad(lr=self.emb_lr)
        )
        self.user_mlp = mp.fsdp(self.user_mlp, strategy)  # sharded from meta
        mp.materialize(self, strategy, seed=self.seed)  # the item MLP, equal on every rank
        self.item_mlp = mp.ddp(self.item_mlp, strategy)
        if self.freeze_tables:
            self.user_tables.requires_grad_(False)
            self.item_tables.requires_grad_(False)

    def configure_optimizers(self) -> dict[str, object]:
        dense = torch.optim.AdamW(self.dense_parameters(), lr=self.lr)
        schedulers: list[object] = [CosineAnnealingLR(dense, T_max=self.steps)]
        if not self.freeze_tables:
            users, items = self.sharded()
            schedulers += [
                CosineAnnealingLR(users.fused_optimizer, T_max=self.steps),
                CosineAnnealingLR(items.fused_optimizer, T_max=self.steps),
            ]
        return {"optimizer": dense, "schedulers": schedulers}

    def prefetch(self, pairs: Pairs) -> None:
        """The next batch's ids start travelling now (the Trainer calls this before each step
        with the next step's batch; TrainPipeline)."""
        users, items = self.sharded()
        users.prefetch(pairs.users)
        items.prefetch(pairs.items)

    def sharded(self) -> tuple[ShardedEmbeddingBagCollection, ShardedEmbeddingBagCollection]:
        """The user and item tables as setup left them."""
        users, items = self.user_tables, self.item_tables
        assert isinstance(users, ShardedEmbeddingBagCollection)
        assert isinstance(items, ShardedEmbeddingBagCollection)
        return users, items

    def embed_users(self, pairs: Pairs) -> torch.Tensor:
        return F.normalize(self.user_mlp(self.user_tables(pairs.users).values), dim=-1)

    def embed_items(self, pairs: Pairs) -> torch.Tensor:
        return self.item_vectors(pairs.items)

    def item_vectors(self, items: SparseFeatures) -> torch.Tensor:
        """The item tower: item_id and item_category features to unit vectors."""
        return F.normalize(self.item_mlp(self.item_tables(items).values), dim=-1)

    def scores(self, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's users against every rank's items: logits (B, W * B) and the labels (the
        column of each user's own item)."""
        assert self.strategy is not None, "call setup(strategy) first"
        users, items = self.embed_users(pairs), self.embed_items(pairs)
        every_item = self.strategy.all_gather(items, differentiable=True).flatten(0, 1)
        labels = torch.arange(len(users), device=users.device) + self.strategy.rank * len(users)
        return users @ every_item.T / self.temperature, labels

    def training_step(self, pairs: Pairs, step: int) -> dict[str, torch.Tensor]:
        logits, labels = self.scores(pairs)
        return {"loss": F.cross_entropy(logits, labels)}

    @torch.no_grad()
    def validation_step(self, pairs: Pairs) -> dict[str, torch.Tensor]:
        """Loss, and how often the best-scored item of the global batch is in the user's
        cluster (chance: 1 / clusters; items of one cluster are interchangeable here)."""
        assert self.strategy is not None
        logits, labels = self.scores(pairs)
        categories = pairs.items["item_category"].values.to(logits.device)
        every_category = self.strategy.all_gather(categories).flatten()
        hit = every_category[logits.argmax(1)] == every_category[labels]
        return {"loss": F.cross_entropy(logits, labels), "cluster_hit": hit.float().mean()}
