"""TableBlocks: one record per table of a sharded collection, built once.

Each record holds what this rank has of one table: its config, its shard of the plan (None:
no block here), the module holding the block's weight (a disk table's: its cache), the fused
optimizer's state for it and the RowStore the rows live in (tier.py). The collection, its fused
optimizer and its step all read the same records, so a per-table fact is stated once.

`local_shards` turns a block's checkpoint chunks (weights or one optimizer state) into the
LocalShards a checkpoint saves and a load writes through: the one place a block's offsets in
the unsharded table are computed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from manualpar.checkpoint.local_shards import Block, LocalShards, current_load
from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.modules.bag_collection import EmbeddingTable
from manualpar.embeddings.plan import Shard
from manualpar.embeddings.storage.replaced_cache import refuse_replaced_cache
from manualpar.embeddings.storage.tier import RowStore, TableStores

__all__ = ["TableBlock", "TableBlocks", "local_shards"]


@dataclass(frozen=True)
class TableBlock:
    """This rank's part of one table; `shard`, `state` and `store` are None without a block."""

    config: EmbeddingBagConfig
    shard: Shard | None
    table: EmbeddingTable  # the block's weight (0 rows without a block; cache rows on disk)
    state: dict[str, torch.Tensor] | None  # the fused optimizer's state tensors of the block
    store: RowStore | None  # where the block's rows live

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def weight(self) -> nn.Parameter:
        return self.table.weight


class TableBlocks:
    """Every table's record, in the collection's table order."""

    def __init__(self, blocks: Sequence[TableBlock]) -> None:
        self.blocks = tuple(blocks)
        self.by_name = {block.name: block for block in self.blocks}
        self.tables = nn.ModuleDict({block.name: block.table for block in self.blocks})
        self.stores = TableStores(
            {t: block.store for t, block in enumerate(self.blocks) if block.store is not None},
            {t: block.name for t, block in enumerate(self.blocks)},
        )

    def __iter__(self) -> Iterator[TableBlock]:
        return iter(self.blocks)

    def held(self) -> list[TableBlock]:
        """The records of the blocks this rank holds."""
        return [block for block in self.blocks if block.shard is not None]


def local_shards(
    block: TableBlock,
    key: str | None,
    dtype: torch.dtype,
    primary_replica: bool = True,
    per_row: bool = False,
) -> LocalShards:
    """The block's weights (`key` None) or optimizer state `key` as LocalShards of the whole
    table ((rows,) if `per_row`, else (rows, dim)), read through its store (a disk tier's: of
    its file, one chunk at a time). One rank saves a replicated table, one replica a 2-D
    layout's (`primary_replica`), and one column block a per-row state."""
    config, shard, store = block.config, block.shard, block.store
    shape = (config.num_embeddings,) if per_row else (config.num_embeddings, config.embedding_dim)
    if shard is None or store is None:  # no block of this table here: an entry without blocks
        return LocalShards(shape, [], dtype)
    if current_load() is None:  # a save: a disk tier's weight must still be its row cache
        refuse_replaced_cache(block.name, store, block.table.weight)
    primary = primary_replica and (not shard.replicated or shard.rank == 0)
    if per_row:  # column blocks all hold the same row statistics: one of them saves them
        primary = primary and shard.col_start == 0
    blocks = [
        Block(
            (shard.row_start + r, shard.col_start)[: len(shape)],
            tensor,
            primary,
            store.drop_pages,
            store.spill_dir,
            store.load_writer(key, r),
        )
        for r, tensor in store.checkpoint_chunks(key)
    ]
    return LocalShards(shape, blocks, dtype)
