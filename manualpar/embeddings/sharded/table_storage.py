"""Where a sharded collection's blocks live: the disk checks, cache sizes, and a RowStore per
block (storage/: in memory, or in a disk-tier file behind a cache)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from manualpar.embeddings.config import EmbeddingBagConfig, block_bytes
from manualpar.embeddings.modules.bag_collection import table_of
from manualpar.embeddings.optim.update_rules import SparseOptimizer
from manualpar.embeddings.plan import EmbeddingPlan, Shard
from manualpar.embeddings.storage.disk_tier import DiskTable, DiskTier
from manualpar.embeddings.storage.memory_rows import MemoryRows
from manualpar.embeddings.storage.tier import RowStore, TableStores
from manualpar.errors import BuilderError

__all__ = ["cache_slots", "check_disk_plan", "table_stores"]


def check_disk_plan(plan: EmbeddingPlan, disk_tier: DiskTier | None, replicated: bool) -> None:
    """Tables on disk need a DiskTier, and a 1-D layout (2-D replicas are not supported)."""
    on_disk = sorted(name for name, p in plan.tables.items() if p.on_disk)
    if disk_tier is not None and not isinstance(disk_tier, DiskTier):
        raise BuilderError(
            f"shard_embeddings(disk_tier=...) takes a DiskTier, got {type(disk_tier).__name__}"
        )
    if on_disk and disk_tier is None:
        raise BuilderError(
            f"the plan places tables {on_disk} on disk, but no disk tier was given; pass "
            "shard_embeddings(..., disk_tier=DiskTier(directory, cache_bytes=...))"
        )
    if on_disk and replicated:
        raise BuilderError(
            f"tables {on_disk} are on disk: the disk tier does not support a 2-D mesh "
            "(replicated shard groups); shard them over a 1-D mesh, or keep them in memory"
        )


def cache_slots(
    configs: Sequence[EmbeddingBagConfig],
    plan: EmbeddingPlan,
    shards: Mapping[str, Shard | None],
    rule: SparseOptimizer,
    disk_tier: DiskTier | None,
) -> dict[str, int]:
    """Cache rows of each disk table block this rank holds."""
    if disk_tier is None:
        return {}
    blocks = {}
    for config in configs:
        shard = shards[config.name]
        if plan.tables[config.name].on_disk and shard is not None:
            width = block_bytes(1, shard.cols, rule.STATE, config.dtype)
            blocks[config.name] = (shard.rows, width)
    return disk_tier.slots(blocks)


def table_stores(
    configs: Sequence[EmbeddingBagConfig],
    seed: int,
    blocks: nn.ModuleDict,
    optimizer_state: Mapping[str, dict[str, torch.Tensor]],
    rank: int,
    source: Any,
    shards: Mapping[str, Shard | None],
    slots: Mapping[str, int],
    disk_tier: DiskTier | None,
    rule: SparseOptimizer,
) -> TableStores:
    """The RowStore of each table block this rank holds: MemoryRows, or a DiskTable for the
    tables with cache `slots` (files created, the source's values written if the unsharded
    collection was materialized). `blocks` holds this rank's (cache-sized) tables,
    `optimizer_state` their fused optimizer's state; `rank` is the rank in the shard group."""
    stores: dict[int, RowStore] = {}
    for t, config in enumerate(configs):
        shard = shards[config.name]
        if shard is None:
            continue
        weight = table_of(blocks, config.name).weight.detach()
        state = optimizer_state[config.name]
        if config.name not in slots:
            stores[t] = MemoryRows(weight, state)
            continue
        assert disk_tier is not None  # slots come from the disk tier
        table = DiskTable(
            config,
            seed,
            shard,
            rule.init_state(1, shard.cols),
            weight,
            state,
            Path(disk_tier.directory),
            rank,
            disk_tier.policy,
            disk_tier.io_threads,
            disk_tier.log_rows(weight.shape[0], shard.rows),
        )
        real = table_of(source.tables, config.name).weight
        if not real.is_meta:
            table.fill_from(real.detach())
        stores[t] = table
    return TableStores(stores, {t: config.name for t, config in enumerate(configs)})
