"""RawIdRemap: the one protocol of a raw-id remap, for every user of one.

Both collections call it on a checked, hashed batch (`__call__`: the batch with rows for the ids
it remaps); a sharded collection's inputs send a batch's raw ids ahead of its forward when the
remap runs an exchange of its own (`exchanges`, `send`, then `finish` at the forward) and join
that exchange with REFUSED sizes for a bad batch (`refuse`); the step remaps the tables left to
it at their owners (`owner_remap`, an OwnerRemap); the Trainer logs the counts
(`raw_id_stats`). Implemented by the unsharded remapper (ids/managed_collisions.py: no
exchange, nothing left to the step) and the sharded one (sharded/managed_collisions.py), whose
tables take one of two paths, chosen per table by ids/buckets.py's `owner_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from manualpar.embeddings.features import SparseFeatures

__all__ = ["STATS", "OwnerRemap", "RawIdRemap", "RawIdRoutes", "RemapSent"]

# raw_id_stats' counts per table, since the last reset: distinct ids seen (summed over steps),
# new ids (holding no row), collisions (new ids finding no free row in their bucket), evictions
# (rows taken from the id holding them)
STATS = ("ids", "new", "collisions", "evictions")


class RawIdRoutes(Protocol):
    """Tables whose raw ids travel to the row block holding their bucket, remapped there
    (step/owner_remap.py): where each raw id goes."""

    @property
    def tables(self) -> frozenset[int]:
        """Indices of those tables in the routing."""

    def route_keys(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """A row of each raw id's bucket, which places it in its row block."""


class OwnerRemap(RawIdRoutes, Protocol):
    """The tables (by index in the routing, `tables`) a rank's step remaps at their owners,
    held or not by this rank, and where their raw ids go (`route_keys`)."""

    def remap(self, table: int, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Table rows of each sender's raw ids of this step (one call per step and table)."""

    def tick(self, held: frozenset[int]) -> None:
        """A step passed on this rank, which remapped the tables in `held`: the others' step
        counts move too (they are the same on every rank)."""


class RemapSent(Protocol):
    """A batch whose raw ids `send` started: nothing remapped yet."""

    def settle(self) -> None:
        """Wait for what travels (a dropped batch: it is never remapped)."""


@runtime_checkable
class RawIdRemap(Protocol):
    """A collection's raw-id remap (managed collisions): a batch's raw ids to rows, with
    per-row state that moves one step per training forward."""

    def __call__(self, features: SparseFeatures) -> SparseFeatures:
        """`features` (the collection's, checked and hashed) with rows for the ids remapped
        here; ids left to the step (`owner_remap`) stay raw."""

    def raw_id_stats(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """Per managed table, the STATS counts since the last reset (sharded: this rank's
        buckets; the sum over ranks is the table's)."""

    @property
    def exchanges(self) -> bool:
        """Whether a call runs an exchange of the remap's own (then `send` starts it)."""

    def send(self, features: SparseFeatures) -> RemapSent:
        """Start a batch's remap without moving the state (a pipeline's next batch)."""

    def finish(self, sent: RemapSent) -> SparseFeatures:
        """The batch `send` started, remapped now: `self(features)` in two halves."""

    def refuse(self) -> None:
        """This rank's batch was refused: join the remap's exchange so every rank stops."""

    def owner_remap(self, names: Sequence[str]) -> OwnerRemap | None:
        """What the step of a collection with tables `names` (its routing's order) remaps at
        the tables' owners, or None."""
