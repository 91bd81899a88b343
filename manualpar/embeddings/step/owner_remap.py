"""Raw ids remapped by the owners of their table, inside the step (no exchange of their own).

A ManagedCollisions table whose blocks hold whole rows (held whole, or split by rows in whole
buckets; one shard group) needs no remap exchange: its raw ids travel in the step's input dist
like row ids, to the block holding their bucket (`route_keys`), and each owner remaps every
sender's ids of the step together in the lookup, before they become slots. The remap is the
collection's OwnerRemap (ids/remap.py; sharded/remap_at_owner.py holds it); this is the step's
side of it. The remap takes the whole step's ids at once, as one process remaps the global
batch, so the owner's own bags wait for the other ranks' ids before their lookup.
"""

from __future__ import annotations

from manualpar.embeddings.ids.remap import OwnerRemap
from manualpar.embeddings.step.exchange import SenderBags
from manualpar.embeddings.step.routing import LocalShard

__all__ = ["remap_senders"]


def remap_senders(
    remap: OwnerRemap, local: list[LocalShard], senders: list[list[SenderBags]]
) -> None:
    """Every sender's raw ids of this rank's shards of remapped tables, replaced by their rows
    (in place); the step counts of the tables remapped elsewhere move too."""
    held = frozenset(shard.table for shard in local if shard.table in remap.tables)
    for k, shard in enumerate(local):
        if shard.table not in held:
            continue
        rows = remap.remap(shard.table, [bags[k][0] for bags in senders])
        start = shard.shard.row_start  # the step addresses rows of this rank's block
        for bags, mapped in zip(senders, rows, strict=True):
            _, lengths, weights = bags[k]
            bags[k] = (mapped - start if start else mapped, lengths, weights)
    remap.tick(held)
