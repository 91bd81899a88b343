"""Synthetic retrieval data: users who each like one cluster of items.

Every user u belongs to segment u % clusters and likes the items of the same cluster
(item i is in cluster i % clusters). A positive pair is a user and a random item of their
cluster. Nothing tells the model which segment matches which cluster: the towers must learn it
from the pairs, through the tables and the MLPs. A batch is addressed by its step (the Trainer's
contract), so a resumed or re-sharded run sees the same pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manualpar.embeddings import SparseFeatures


@dataclass
class Pairs:
    users: SparseFeatures  # user_id, user_segment: one id each
    items: SparseFeatures  # item_id, item_category: one id each

    def __len__(self) -> int:
        return self.users.batch_size


@dataclass
class RetrievalData:
    users: int
    items: int
    clusters: int
    batch_size: int  # global: every rank takes its share
    seed: int = 0

    def pairs(self, index: int, rank: int, world_size: int, *, validation: bool = False) -> Pairs:
        if self.batch_size % world_size:
            raise ValueError(
                f"batch size {self.batch_size} is not a multiple of the world size {world_size}"
            )
        local = self.batch_size // world_size
        offset = 1_000_003 if validation else 0  # validation pairs never repeat training ones
        generator = torch.Generator().manual_seed(self.seed * 7_919 + offset + index)
        user = torch.randint(self.users, (self.batch_size,), generator=generator)
        per_cluster = self.items // self.clusters
        member = torch.randint(per_cluster, (self.batch_size,), generator=generator)
        item = member * self.clusters + user % self.clusters  # an item of the user's cluster
        mine = slice(rank * local, (rank + 1) * local)
        user, item = user[mine], item[mine]
        return Pairs(
            _one_id_each({"user_id": user, "user_segment": user % self.clusters}),
            _one_id_each({"item_id": item, "item_category": item % self.clusters}),
        )

    def train(self, index: int, strategy: object) -> Pairs:
        return self.pairs(index, strategy.rank, strategy.world_size)  # type: ignore[attr-defined]

    def validation(self, index: int, strategy: object) -> Pairs:
        return self.pairs(
            index,
            strategy.rank,  # type: ignore[attr-defined]
            strategy.world_size,  # type: ignore[attr-defined]
            validation=True,
        )


def _one_id_each(features: dict[str, torch.Tensor]) -> SparseFeatures:
    """One id per sample and feature."""
    values = torch.cat(list(features.values()))
    return SparseFeatures(tuple(features), values, torch.ones_like(values))
