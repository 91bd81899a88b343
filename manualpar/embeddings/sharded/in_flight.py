"""The batch a pipeline sent ahead: its input dist started, its lookup not yet run.

`emb.prefetch(features)` runs the checks, the hashing and the input dist of a batch (the size
exchange, then the ids on their way to their owners) before the current batch's step, so the
ids travel while it computes (raw ids of ManagedCollisions tables held by rows among them,
remapped by their owners at the lookup). A collection with managed tables that need the remap
exchange sends its raw ids to their remappers instead (sharded/managed_collisions.py, `send`):
the remap and the input dist wait for the batch's forward. The forward of that very batch (the
same SparseFeatures object) takes them; any other forward (a validation batch, say) runs whole,
as if nothing were held.

Nothing in an input dist or a remapper's send reads or writes a row or a remapper's state, so
holding a batch changes no number. What the input dist does fix early is which tables are
frozen (the exchange agrees on that): a table's `requires_grad` changed while a batch is in
flight is refused when that batch's forward comes. At most two batches are held: the current
one and the next. Over a disk tier, a held batch's rows are also read into the cache and pinned
(step/forward.py, `fetch`): its own slots, which the current step's update changes in place
where the batches share a row; dropping the batch unpins them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.sharded.managed_collisions import RemapInFlight
from manualpar.embeddings.step.frozen import frozen_tables
from manualpar.embeddings.step.results import RoutedIds
from manualpar.errors import EmbeddingInputError

__all__ = ["InFlight"]


@dataclass(frozen=True)
class _Held:
    key: SparseFeatures  # the batch as the caller passed it to prefetch
    routed: RoutedIds | RemapInFlight  # its input dist, or its raw ids' send to the remappers
    extra: Any  # what the collection needs besides (a sequence collection's id counts)
    frozen: frozenset[int]  # this rank's frozen tables when its input dist ran


class InFlight:
    """The prefetched batches of one collection, at most two: the one a pipeline handed out
    (prefetched one step earlier, its forward still to come) and the next (see the module
    docstring)."""

    LIMIT = 2

    def __init__(self, tables: nn.ModuleDict, names: list[str]) -> None:
        self.tables, self.names = tables, names
        self._held: list[_Held] = []

    @property
    def holding(self) -> int:
        return len(self._held)

    def check_free(self) -> None:
        """Refuse a third batch before its input dist starts (the same on every rank)."""
        if len(self._held) >= self.LIMIT:
            raise EmbeddingInputError(
                f"{BUILDER}: prefetch() while {self.LIMIT} batches are in flight (the current "
                "one and the next): run the forward of the batches prefetched before (the same "
                "SparseFeatures objects you passed to prefetch, not copies such as "
                ".to(device)), or drop them (emb.drop_prefetched())"
            )

    def hold(
        self, key: SparseFeatures, routed: RoutedIds | RemapInFlight, extra: Any = None
    ) -> None:
        self.check_free()
        self._held.append(_Held(key, routed, extra, frozen_tables(self.tables, self.names)))

    def take(self, key: SparseFeatures) -> tuple[RoutedIds | RemapInFlight, Any] | None:
        """A held batch's routed ids if `key` is that batch, else None (run it whole)."""
        found = next((h for h in self._held if h.key is key), None)
        if found is None:
            return None
        self._held.remove(found)
        now = frozen_tables(self.tables, self.names)
        if now != found.frozen:
            found.routed.settle()  # nothing of it stays pinned
            changed = [self.names[t] for t in sorted(now ^ found.frozen)]
            raise EmbeddingInputError(
                f"{BUILDER}: the requires_grad of table(s) {changed} changed while this batch "
                "was in flight (its input dist, which fixes the frozen tables, ran before the "
                "change): change requires_grad between pipelines, not inside one, or drop the "
                "batches in flight first (emb.drop_prefetched())"
            )
        return found.routed, found.extra

    def drop(self) -> None:
        """Forget the held batches: wait for their ids, unpin the rows read in ahead."""
        for held in self._held:
            held.routed.settle()
        self._held = []
