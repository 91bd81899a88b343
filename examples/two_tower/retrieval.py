"""Retrieval over every item: the item tower's vectors in a table sharded over the ranks, searched
with `top_k_items` (each rank scores the items it holds; the best k are merged across ranks).

The index is built once after training: each rank embeds a share of the items (its lookups are
the towers' sharded ones), the vectors are assembled, and `shard_embeddings` keeps each rank's
row block only. (Assembling the whole matrix first is fine for this example's 4,096 items; an
index of millions of items would write each rank's block from the vectors it computed.)
"""

from __future__ import annotations

import torch
from data import Pairs
from model import TwoTower

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    top_k_items,
)

INDEX = "item_vectors"


def _items(ids: torch.Tensor, clusters: int) -> SparseFeatures:
    values = torch.cat([ids, ids % clusters])
    return SparseFeatures(("item_id", "item_category"), values, torch.ones_like(values))


@torch.no_grad()
def item_index(
    model: TwoTower, strategy: mp.ManualParallelStrategy
) -> ShardedEmbeddingBagCollection:
    """Every item's vector, in a row-wise sharded table (never trained: frozen)."""
    items, world = model.items, strategy.world_size
    share = -(-items // world)
    mine = torch.arange(strategy.rank * share, min((strategy.rank + 1) * share, items))
    vectors = model.item_vectors(_items(mine, model.clusters))
    padded = vectors.new_zeros(share, vectors.shape[1])
    padded[: len(vectors)] = vectors
    every = strategy.all_gather(padded).flatten(0, 1)[:items]
    table = EmbeddingBagCollection([EmbeddingBagConfig(INDEX, items, vectors.shape[1])])
    weight = table.tables[INDEX].weight
    assert isinstance(weight, torch.Tensor)
    weight.copy_(every)
    index = shard_embeddings(table, strategy, plan={INDEX: row_wise()}, rule=RowWiseAdagrad(lr=0))
    return index.requires_grad_(False)


@torch.no_grad()
def precision_at(
    model: TwoTower,
    index: ShardedEmbeddingBagCollection,
    pairs: Pairs,
    k: int,
    strategy: mp.ManualParallelStrategy,
) -> float:
    """The share of each user's k best items (over all items) that are in the user's cluster,
    over every rank's users (chance: 1 / clusters)."""
    _, ids = top_k_items(index, INDEX, model.embed_users(pairs), k)
    segments = pairs.users["user_segment"].values
    hits = (ids % model.clusters == segments.unsqueeze(1)).sum()
    totals = torch.tensor([float(hits), float(ids.numel())], dtype=torch.float64)
    hit, count = strategy.all_reduce(totals, op="sum").tolist()
    return hit / count
