"""Sharded embedding tables: configs, jagged inputs, plans, fused sparse optimizers."""

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.features import JaggedFeature, SparseFeatures
from manualpar.embeddings.id_spaces import HashIds, ManagedCollisions
from manualpar.embeddings.modules.bag_collection import (
    EmbeddingBagCollection,
    EmbeddingTable,
    PooledEmbeddings,
)
from manualpar.embeddings.modules.sequence_collection import (
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedEmbeddings,
    SequenceEmbeddings,
)
from manualpar.embeddings.optim.fused_optimizer import FusedOptimizer
from manualpar.embeddings.optim.update_rules import (
    SGD,
    Adagrad,
    Adam,
    RowWiseAdagrad,
    SparseOptimizer,
)
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
from manualpar.embeddings.planning.planner import plan_collections
from manualpar.embeddings.sharded.bag_collection import ShardedEmbeddingBagCollection
from manualpar.embeddings.sharded.sequence_collection import ShardedEmbeddingCollection
from manualpar.embeddings.sharded.shard_embeddings import shard_embeddings
from manualpar.embeddings.storage.disk_tier import DiskTier

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
