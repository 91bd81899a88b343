"""The at-owner path of a sharded collection's raw-id remap: the step remaps a table's raw ids.

A managed table held whole by one rank, or split by rows over some ranks (table-, row- or
table-row-wise, no replicas: ids/buckets.py's `owner_blocks` chooses), is remapped by the ranks
holding it, inside the step (step/owner_remap.py): a managed table's row blocks are whole
buckets (plan.py), its raw ids reach the block holding their bucket in the step's own input
dist, and each block's owner holds its buckets' remapper state (sharded/managed_collisions.py).
It costs no exchange of its own, which is why it stays beside the remap exchange: table-wise,
the managed step measured 1.57x the rows step here against 2.06x through the exchange
(bench_raw_ids.py, docs/benchmarks.md "Raw ids").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.ids.buckets import (
    buckets_of,
    managed_setting,
    managed_tables,
    owner_blocks,
)
from manualpar.embeddings.ids.managed_collisions import ManagedCollisionTable
from manualpar.embeddings.plan import EmbeddingPlan
from manualpar.embeddings.step.table_mesh import TableMesh

__all__ = ["RemapAtOwner", "remapped_at_owner"]


class RemapAtOwner:
    """The step's view of the tables remapped at their owners (ids/remap.py's OwnerRemap), by
    routing index; `table` gives a table's remapper state by name."""

    def __init__(
        self, table: Callable[[str], ManagedCollisionTable], names: dict[int, str]
    ) -> None:
        self.table, self.names = table, names
        self.tables = frozenset(names)

    def remap(self, table: int, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every sender's raw ids together, as one process remaps the global batch."""
        rows = self.table(self.names[table]).remap_counted(torch.cat(ids))
        return list(rows.split([part.numel() for part in ids]))

    def route_keys(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """The first row of each raw id's bucket: where a row-split table's id is sent."""
        managed = self.table(self.names[table])
        buckets = buckets_of(ids, managed.config, native=managed.native)
        return buckets * managed_setting(managed.config).bucket_rows

    def tick(self, held: frozenset[int]) -> None:
        """The step count of the tables remapped on other ranks moves with theirs (a
        checkpoint saves any rank's)."""
        for t, name in self.names.items():
            table = self.table(name)
            if t not in held and table.training:
                table.step += 1


def remapped_at_owner(
    configs: Sequence[EmbeddingBagConfig], plan: EmbeddingPlan, mesh: TableMesh
) -> dict[str, dict[int, tuple[int, int]]]:
    """The managed tables a collection's step remaps at their owners, with each owner's job
    rank and buckets (`owner_blocks`), without replicas; the others go through the remap
    exchange."""
    if mesh.replicas > 1:
        return {}
    owners = {}
    for config in managed_tables(configs):
        if blocks := owner_blocks(config, plan):
            owners[config.name] = {mesh.group_ranks[r]: b for r, b in blocks.items()}
    return owners
