"""Sharded embedding tables: configs, jagged inputs, collections, plans, the planner, fused
sparse optimizers, storage tiers and raw ids.

This module is the embeddings' public vocabulary: everything a model, a training script or a
plan file needs is importable from here. The sub-packages below it are internal (one concern
each, in one-way layers; docs/embeddings.md, "Layout"):

    root vocabulary  config, features, plan, id_spaces, dtype_names
    kernels/         C++ kernels and loader, splitmix64, bags and pooling, rounding, row memory
    ids/  optim/     raw ids (hashing, managed collisions); update rules, the fused optimizer
    modules/         the unsharded bag and sequence collections, table init
    storage/         where a block's rows live (memory, the disk tier)
    planning/ step/  the planner; one sharded step (routing, exchanges, lookup, update)
    sharded/         shard_embeddings, the sharded collections, ranking against every row
"""

from manualpar.checkpoint.local_shards import LocalShards, full_tensors
from manualpar.embeddings.config import TABLE_DTYPES, EmbeddingBagConfig, block_bytes, check_tables
from manualpar.embeddings.dtype_names import DTYPE_NAMES, dtype_name, table_dtype
from manualpar.embeddings.features import JaggedFeature, SparseFeatures
from manualpar.embeddings.id_spaces import (
    EVICTION_POLICIES,
    HashIds,
    ManagedCollisions,
    RawIds,
    raw_ids_from_json,
    raw_ids_to_json,
)
from manualpar.embeddings.kernels.row_memory import available_bytes
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
    SHARDING_TYPES,
    EmbeddingPlan,
    Shard,
    TablePlacement,
    column_wise,
    data_parallel,
    format_bytes,
    on_disk,
    row_wise,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.plan_text import per_rank_text
from manualpar.embeddings.planning.cost_model import placement_costs, plan_costs
from manualpar.embeddings.planning.cost_planner import CostPlan, plan_by_cost
from manualpar.embeddings.planning.cost_text import costs_text, format_seconds
from manualpar.embeddings.planning.exchange_bytes import (
    ExchangeBytes,
    exchange_bytes,
    expected_exchange_bytes,
    expected_sent_bytes,
)
from manualpar.embeddings.planning.planner import (
    DEFAULT_BATCH_PER_RANK,
    UNIFORM_PLANS,
    default_topology,
    plan_collections,
    plan_tables,
    plan_uniform,
    table_bytes,
)
from manualpar.embeddings.planning.rank_costs import RankCosts, Workload, rule_costs
from manualpar.embeddings.planning.remapper_budget import remapper_bytes_on_ranks
from manualpar.embeddings.planning.topology import TOPOLOGY_PRESETS, Topology, load_topology
from manualpar.embeddings.sharded.bag_collection import ShardedEmbeddingBagCollection
from manualpar.embeddings.sharded.ranking import target_ranks, top_k_items
from manualpar.embeddings.sharded.sequence_collection import ShardedEmbeddingCollection
from manualpar.embeddings.sharded.shard_embeddings import shard_embeddings
from manualpar.embeddings.step.wire import WireDtypes
from manualpar.embeddings.storage.disk_tier import CacheTooSmall, DiskTier

__all__ = [
    "DEFAULT_BATCH_PER_RANK",
    "DTYPE_NAMES",
    "EVICTION_POLICIES",
    "SGD",
    "SHARDING_TYPES",
    "TABLE_DTYPES",
    "TOPOLOGY_PRESETS",
    "UNIFORM_PLANS",
    "Adagrad",
    "Adam",
    "CacheTooSmall",
    "CostPlan",
    "DiskTier",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingPlan",
    "EmbeddingTable",
    "ExchangeBytes",
    "FusedOptimizer",
    "HashIds",
    "JaggedEmbeddings",
    "JaggedFeature",
    "LocalShards",
    "ManagedCollisions",
    "PooledEmbeddings",
    "RankCosts",
    "RawIds",
    "RowWiseAdagrad",
    "SequenceEmbeddings",
    "Shard",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "SparseFeatures",
    "SparseOptimizer",
    "TablePlacement",
    "Topology",
    "WireDtypes",
    "Workload",
    "available_bytes",
    "block_bytes",
    "check_tables",
    "column_wise",
    "costs_text",
    "data_parallel",
    "default_topology",
    "dtype_name",
    "exchange_bytes",
    "expected_exchange_bytes",
    "expected_sent_bytes",
    "format_bytes",
    "format_seconds",
    "full_tensors",
    "load_topology",
    "on_disk",
    "per_rank_text",
    "placement_costs",
    "plan_by_cost",
    "plan_collections",
    "plan_costs",
    "plan_tables",
    "plan_uniform",
    "raw_ids_from_json",
    "raw_ids_to_json",
    "remapper_bytes_on_ranks",
    "row_wise",
    "rule_costs",
    "shard_embeddings",
    "table_bytes",
    "table_dtype",
    "table_row_wise",
    "table_wise",
    "target_ranks",
    "top_k_items",
]
