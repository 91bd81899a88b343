"""Sharded embedding tables: configs, jagged inputs, plans, fused sparse optimizers."""

from manualpar.embeddings.collection import (
    EmbeddingBagCollection,
    EmbeddingTable,
    PooledEmbeddings,
)
from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.disk_tier import DiskTier
from manualpar.embeddings.features import JaggedFeature, SparseFeatures
from manualpar.embeddings.fused_optimizer import FusedOptimizer
from manualpar.embeddings.id_spaces import HashIds, ManagedCollisions
from manualpar.embeddings.plan import (
    EmbeddingPlan,
    Shard,
    TablePlacement,
    column_wise,
    data_parallel,
    on_disk,
    row_wise,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.planner import plan_collections
from manualpar.embeddings.sequence import (
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedEmbeddings,
    SequenceEmbeddings,
)
from manualpar.embeddings.sharded import (
    ShardedEmbeddingBagCollection,
    ShardedEmbeddingCollection,
    shard_embeddings,
)
from manualpar.embeddings.update_rules import SGD, Adagrad, Adam, RowWiseAdagrad, SparseOptimizer

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "DiskTier",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingPlan",
    "EmbeddingTable",
    "FusedOptimizer",
    "HashIds",
    "JaggedEmbeddings",
    "JaggedFeature",
    "ManagedCollisions",
    "PooledEmbeddings",
    "RowWiseAdagrad",
    "SequenceEmbeddings",
    "Shard",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "SparseFeatures",
    "SparseOptimizer",
    "TablePlacement",
    "column_wise",
    "data_parallel",
    "on_disk",
    "plan_collections",
    "row_wise",
    "shard_embeddings",
    "table_row_wise",
    "table_wise",
]
