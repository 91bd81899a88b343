"""ManagedCollisionRemapper: a collection's ManagedCollisions tables, remapped in one process.

The RawIdRemap (remap.py) of the unsharded collections, one ManagedCollisionTable
(managed_table.py) per managed table holding its whole state: no exchange and nothing left to
the step, so `send` only holds the batch and `finish` remaps it. The sharded remapper
(sharded/managed_collisions.py) is one with the rank's buckets of each table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.ids.buckets import managed_tables
from manualpar.embeddings.ids.hashing import table_ids, with_table_ids
from manualpar.embeddings.ids.managed_table import NATIVE_BUCKET_ROWS, ManagedCollisionTable
from manualpar.embeddings.ids.remap import STATS, OwnerRemap, RemapSent

__all__ = [
    "NATIVE_BUCKET_ROWS",
    "STATS",
    "ManagedCollisionRemapper",
    "ManagedCollisionTable",
    "managed_per_sample",
    "managed_remapper",
]


class ManagedCollisionRemapper(nn.Module):
    """The managed tables of a collection, each a ManagedCollisionTable: forward maps their
    features' raw ids to rows (one step of every table). Single-process: the whole tables.
    A RawIdRemap (remap.py)."""

    def __init__(
        self, configs: Sequence[EmbeddingBagConfig], device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.configs = tuple(configs)
        self.tables = nn.ModuleDict(
            {c.name: ManagedCollisionTable(c, device=device) for c in managed_tables(configs)}
        )

    def table(self, name: str) -> ManagedCollisionTable:
        table = self.tables[name]
        assert isinstance(table, ManagedCollisionTable), name
        return table

    def forward(self, features: SparseFeatures) -> SparseFeatures:
        """`features` (the collection's features in its order) with managed ids as rows."""
        rows = {}
        managed = managed_tables(self.configs)
        for name, ids in table_ids(features, self.configs, managed).items():
            rows[name] = self.table(name).remap_counted(ids)
        return with_table_ids(features, self.configs, rows)

    def raw_id_stats(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """Per managed table: ids, new, collisions, evictions counted since the last reset
        (sharded: this rank's buckets; the sum over ranks is the table's)."""
        return {name: self.table(name).take_stats(reset) for name in self.tables}

    @property
    def exchanges(self) -> bool:
        """One process remaps every bucket: no exchange of its own."""
        return False

    def send(self, features: SparseFeatures) -> RemapSent:
        """Nothing travels: the batch waits for `finish` as it is."""
        return _Held(features)

    def finish(self, sent: RemapSent) -> SparseFeatures:
        assert isinstance(sent, _Held), type(sent)  # what `send` returned
        return self(sent.features)

    def refuse(self) -> None:
        """No exchange to stop the other ranks at: the step's own exchange does."""

    def owner_remap(self, names: Sequence[str]) -> OwnerRemap | None:
        """Every table is remapped here, before the step."""
        return None


@dataclass(frozen=True)
class _Held:
    """A batch `send` held for `finish` (nothing travels in one process)."""

    features: SparseFeatures

    def settle(self) -> None:
        """Nothing in flight."""


def managed_remapper(
    configs: Sequence[EmbeddingBagConfig], device: torch.device | str | None
) -> ManagedCollisionRemapper | None:
    """The collection's remapper, or None when no table has ManagedCollisions."""
    return ManagedCollisionRemapper(configs, device) if managed_tables(configs) else None


def managed_per_sample(
    features: SparseFeatures, configs: Sequence[EmbeddingBagConfig]
) -> SparseFeatures:
    """A batch per feature with the bags of ManagedCollisions tables' features expanded to one
    per sample (SparseFeatures.expand), before their remap: it counts an id once per sample
    reading it, as the expanded batch the variable one stands for does (a bucket's new ids
    take its free rows most-counted first; lfu keeps the most counted), where a bag read by
    several samples would count once and so give other rows. Those features' bags then travel
    and are looked up per sample; the other features keep their own bags."""
    if not features.variable_batch:
        return features
    return features.expand([f for c in managed_tables(configs) for f in c.feature_names])
