"""A managed table's buckets: which rows each bucket holds, which bucket a raw id hashes to,
which rank remaps it (`owner_blocks`: the one choice between the two sharded paths), and what
the remapper's per-row state costs (ids/managed_table.py remaps; sharded/managed_collisions.py
splits the buckets over the ranks; the planner counts the state)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.id_spaces import ManagedCollisions
from manualpar.embeddings.ids.hashing import hash_ids, salt_key, unsigned_mod
from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.plan import EmbeddingPlan
from manualpar.embeddings.row_blocks import largest_row_block

__all__ = [
    "REMAPPED_AT_OWNER",
    "REMAPPER_ROW_BYTES",
    "STATE",
    "BucketLayout",
    "buckets_of",
    "layout_of",
    "managed_setting",
    "managed_tables",
    "owner_blocks",
    "remapper_bytes_at_owner",
    "remapper_bytes_per_rank",
]

STATE = ("ids", "last_seen", "counts")  # the per-row int64 state, checkpointed as row blocks
_STATE_BYTES = 8  # each STATE entry is one int64 per row
REMAPPER_ROW_BYTES = len(STATE) * _STATE_BYTES  # a remapper's state per row of its table


def remapper_bytes_per_rank(tables: Sequence[EmbeddingBagConfig], world_size: int) -> int:
    """What each rank's share of the managed-collision remappers holds at most: STATE for the
    rows of the largest even split of every managed table's buckets over all ranks (so the
    planner counts it on every rank, outside the tables' placements; a table placed whole on
    one rank adds remapper_bytes_at_owner there). Whole buckets: 1000 rows of 64-row buckets
    split 512 and 488 rows on 2 ranks, so the share is 512, not 500."""
    rows = sum(
        largest_row_block(t, world_size) for t in tables if isinstance(t.raw_ids, ManagedCollisions)
    )
    return rows * REMAPPER_ROW_BYTES


# Placements whose blocks hold whole rows: a managed table placed so is remapped by the owners
# of its blocks, in the step (owner_blocks; sharded/remap_at_owner.py), without replicas.
REMAPPED_AT_OWNER = ("table_wise", "row_wise", "table_row_wise")


def owner_blocks(config: EmbeddingBagConfig, plan: EmbeddingPlan) -> dict[int, tuple[int, int]]:
    """The buckets [first, end) each plan rank's block of a managed table holds, for a table
    remapped at its owners (placed in whole rows: REMAPPED_AT_OWNER); empty for one whose
    buckets are split evenly over the job instead (`BucketLayout.owned`), through the remap
    exchange, and for a table without managed ids. The at-owner path costs no exchange of its
    own: table-wise, the managed step measured 1.57x the rows step at the owner against 2.06x
    through the exchange (bench_raw_ids.py, docs/benchmarks.md), so both paths stay."""
    if not isinstance(config.raw_ids, ManagedCollisions):
        return {}
    if plan.tables[config.name].sharding not in REMAPPED_AT_OWNER:
        return {}
    layout = layout_of(config)
    return {
        shard.rank: layout.of_rows(shard.row_start, shard.row_end) for shard in plan.shards(config)
    }


def remapper_bytes_at_owner(
    config: EmbeddingBagConfig, world_size: int, rows: int | None = None
) -> int:
    """What the owner of a managed table's block of `rows` rows (default: the whole table),
    remapped there (REMAPPED_AT_OWNER), holds beyond the share remapper_bytes_per_rank counts
    on every rank: its block's whole state. Ranks holding less keep their counted share
    unused, so a plan errs on the safe side."""
    if not isinstance(config.raw_ids, ManagedCollisions):
        return 0
    held = config.num_embeddings if rows is None else rows
    share = largest_row_block(config, world_size)
    return max(0, held - share) * REMAPPER_ROW_BYTES


@dataclass(frozen=True)
class BucketLayout:
    """A managed table's buckets: bucket k holds rows [k * bucket_rows, min(.., rows))."""

    rows: int
    bucket_rows: int

    @property
    def num_buckets(self) -> int:
        return -(-self.rows // self.bucket_rows)

    def owned(self, rank: int, world_size: int) -> tuple[int, int]:
        """The buckets [first, end) rank `rank` of `world_size` remaps (contiguous, even)."""
        buckets = self.num_buckets
        return rank * buckets // world_size, (rank + 1) * buckets // world_size

    def of_rows(self, row_start: int, row_end: int) -> tuple[int, int]:
        """The buckets [first, end) of a block of rows [row_start, row_end) (managed tables'
        row blocks are whole buckets, plan.py; an empty block at the table's end, where a
        table has fewer buckets than blocks, holds none)."""
        return -(-row_start // self.bucket_rows), -(-row_end // self.bucket_rows)

    def row_range(self, buckets: tuple[int, int]) -> tuple[int, int]:
        """The rows of buckets [first, end) (empty at the table's end when first == end ==
        num_buckets: a rank holding none of a table remapped elsewhere)."""
        return (
            min(buckets[0] * self.bucket_rows, self.rows),
            min(buckets[1] * self.bucket_rows, self.rows),
        )


def managed_tables(configs: Sequence[EmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    return [c for c in configs if isinstance(c.raw_ids, ManagedCollisions)]


def managed_setting(config: EmbeddingBagConfig) -> ManagedCollisions:
    """A managed table's ManagedCollisions (its raw_ids)."""
    assert isinstance(config.raw_ids, ManagedCollisions), config.name
    return config.raw_ids


def layout_of(config: EmbeddingBagConfig) -> BucketLayout:
    return BucketLayout(config.num_embeddings, managed_setting(config).bucket_rows)


def buckets_of(ids: torch.Tensor, config: EmbeddingBagConfig, native: bool = False) -> torch.Tensor:
    """Each raw id's bucket in its table; `native`: in one C++ pass where the kernels take the
    ids (kernels/csrc/raw_ids.cpp: 24 us for 5,120 ids against 86 us of torch ops)."""
    salt, buckets = managed_setting(config).salt, layout_of(config).num_buckets
    if native and native_kernels_take(ids):
        return loaded_kernels().hash_feature_ids(
            ids.to(torch.int64).contiguous(),
            torch.tensor([0, ids.numel()]),
            torch.tensor([salt_key(salt)]),
            torch.tensor([buckets]),
        )
    return unsigned_mod(hash_ids(ids, salt), buckets)
