"""Sharded embedding tables: configs, sparse inputs, collections, plans and placements, update
rules, the disk tier, raw ids, ranking.

This module is the face a model author holds: what a model and its training script write.
Planning (the planner, its cost model and the table lists and plan text the command line
reads and prints) has its own public namespace, `manualpar.embeddings.planning`. Names that
left this face in 0.3 still work with a warning (manualpar/deprecated.py). The sub-packages
below are internal (one concern each, in one-way layers; docs/embeddings.md, "Layout"):

    root vocabulary  config, features, plan, id_spaces, dtype_names
    kernels/         C++ kernels and loader, splitmix64, bags and pooling, rounding, row memory
    ids/  optim/     raw ids (hashing, managed collisions, the RawIdRemap protocol); update
                     rules, the fused optimizer
    modules/         the unsharded bag and sequence collections, table init
    storage/         where a block's rows live (memory, the disk tier)
    planning/ step/  the planner; one sharded step (routing, exchanges, lookup, update)
    sharded/         shard_embeddings, the sharded collections, ranking against every row
"""

import importlib

from manualpar import deprecated
from manualpar.embeddings import planning
from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.id_spaces import HashIds, ManagedCollisions, RawIds
from manualpar.embeddings.ids.remap import RawIdRemap
from manualpar.embeddings.modules.bag_collection import EmbeddingBagCollection, PooledEmbeddings
from manualpar.embeddings.modules.sequence_collection import (
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedEmbeddings,
    SequenceEmbeddings,
)
from manualpar.embeddings.optim.fused_optimizer import FusedOptimizer
from manualpar.embeddings.optim.update_rules import SGD, Adagrad, Adam, RowWiseAdagrad, UpdateRule
from manualpar.embeddings.plan import (
    EmbeddingPlan,
    TablePlacement,
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.plan import on_disk as _on_disk  # noqa: F401 (deprecated.py gives it)
from manualpar.embeddings.sharded.bag_collection import ShardedEmbeddingBagCollection
from manualpar.embeddings.sharded.ranking import target_ranks, top_k_items
from manualpar.embeddings.sharded.sequence_collection import ShardedEmbeddingCollection
from manualpar.embeddings.sharded.shard_embeddings import shard_embeddings
from manualpar.embeddings.step.wire import WireDtypes
from manualpar.embeddings.storage.disk_tier import CacheTooSmall, DiskTier

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "CacheTooSmall",
    "DiskTier",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingPlan",
    "FusedOptimizer",
    "HashIds",
    "JaggedEmbeddings",
    "ManagedCollisions",
    "PooledEmbeddings",
    "RawIdRemap",
    "RawIds",
    "RowWiseAdagrad",
    "SequenceEmbeddings",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "SparseFeatures",
    "TablePlacement",
    "UpdateRule",
    "WireDtypes",
    "column_wise",
    "data_parallel",
    "planning",
    "row_wise",
    "shard_embeddings",
    "table_row_wise",
    "table_wise",
    "target_ranks",
    "top_k_items",
]


def __getattr__(name: str) -> object:
    """A name that left this face or was renamed in 0.3 (deprecated.py): a warning giving its
    new spelling, then the object itself."""
    home, new = deprecated.moved(__name__, name)
    return getattr(importlib.import_module(home), new)
