"""Where a sharded collection's blocks live: the disk checks, cache sizes, and each table's
record (storage/table_blocks.py): its block's weight, optimizer state and RowStore, in memory
or in a disk-tier file behind a cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from manualpar.embeddings.config import EmbeddingBagConfig, block_bytes
from manualpar.embeddings.modules.bag_collection import (
    EmbeddingBagCollection,
    EmbeddingTable,
    table_of,
)
from manualpar.embeddings.modules.sequence_collection import EmbeddingCollection
from manualpar.embeddings.modules.table_init import init_rows
from manualpar.embeddings.optim.update_rules import UpdateRule
from manualpar.embeddings.plan import EmbeddingPlan, Shard
from manualpar.embeddings.step.routing import Routing
from manualpar.embeddings.storage.disk_tier import DiskTable, DiskTier
from manualpar.embeddings.storage.memory_rows import MemoryRows
from manualpar.embeddings.storage.table_blocks import TableBlock, TableBlocks
from manualpar.embeddings.storage.tier import RowStore
from manualpar.errors import BuilderError

__all__ = ["check_disk_plan", "table_blocks"]


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


def table_blocks(
    source: EmbeddingBagCollection | EmbeddingCollection,
    routing: Routing,
    plan: EmbeddingPlan,
    rule: UpdateRule,
    device: torch.device,
    disk_tier: DiskTier | None,
) -> TableBlocks:
    """Each table's record on this rank: its block's weight (the source's values if it was
    materialized, else the seeded initial values), the fresh optimizer state and the store;
    a table the plan puts on disk gets a file (written from a materialized source) and a cache
    sized by the disk tier."""
    configs = source.configs
    shards: dict[str, Shard | None] = {config.name: None for config in configs}
    for local in reversed(routing.local_shards):  # the first block of each table
        shards[configs[local.table].name] = local.shard
    slots = _cache_slots(configs, plan, shards, rule, disk_tier)
    blocks = []
    for config in configs:
        shard, real = shards[config.name], table_of(source.tables, config.name).weight
        rows = slots.get(config.name, shard.rows) if shard else 0
        table = EmbeddingTable(config, source.seed, rows, shard.cols if shard else None, device)
        table.weight.requires_grad_(real.requires_grad)  # frozen before sharding stays so
        if shard is None:
            blocks.append(TableBlock(config, None, table, None, None))
            continue
        weight, state = table.weight.detach(), rule.init_state(rows, shard.cols, device)
        store: RowStore
        if plan.tables[config.name].on_disk:
            assert disk_tier is not None  # check_disk_plan
            cache = (weight, state)
            store = _disk_table(config, source.seed, shard, routing.rank, rule, cache, disk_tier)
            if not real.is_meta:
                store.fill_from(real.detach())
        else:
            _fill_block(weight, real, config, source.seed, shard)
            store = MemoryRows(table, state, config.name)
        blocks.append(TableBlock(config, shard, table, state, store))
    return TableBlocks(blocks)


def _cache_slots(
    configs: Sequence[EmbeddingBagConfig],
    plan: EmbeddingPlan,
    shards: Mapping[str, Shard | None],
    rule: UpdateRule,
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


def _disk_table(
    config: EmbeddingBagConfig,
    seed: int,
    shard: Shard,
    rank: int,
    rule: UpdateRule,
    cache: tuple[torch.Tensor, dict[str, torch.Tensor]],
    disk_tier: DiskTier,
) -> DiskTable:
    """The block's file and its `cache` (the weight and state slots); `rank`: in the shard
    group."""
    weight, state = cache
    return DiskTable(
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


def _fill_block(
    weight: torch.Tensor, source: nn.Parameter, config: EmbeddingBagConfig, seed: int, shard: Shard
) -> None:
    """This rank's block: the source's values if it is real, else the seeded initial values."""
    with torch.no_grad():
        if source.is_meta:  # generated in place: no second copy of the block, even briefly
            init_rows(
                config,
                seed,
                (shard.row_start, shard.row_end),
                (shard.col_start, shard.col_end),
                out=weight,
            )
        else:
            weight.copy_(source[shard.row_start : shard.row_end, shard.col_start : shard.col_end])
