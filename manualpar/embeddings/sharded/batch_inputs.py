"""BatchInputs: a sharded collection's batches on their way to the lookup.

Every batch becomes one PreparedBatch: the collection's input shape (`InputShape`: a bag
collection's check, a sequence collection's ids as bags of one) checks it, it moves to the
device, its raw ids are hashed (ids/hashing.py) and those of ManagedCollisions tables remapped
(the collection's RawIdRemap, ids/remap.py; tables remapped at their owner keep raw ids until
the step's lookup). A bad batch still joins the first exchange, with REFUSED sizes, so every
rank stops at this step with an error instead of waiting for the collective timeout.

`prefetch(features)` runs the same preparation and the batch's input dist (the size exchange,
then the ids on their way to their owners) before the current batch's step, so the ids travel
while it computes. A collection with managed tables that need the remap exchange sends the raw
ids to their remappers instead (`send`): the remap and the input dist wait for the batch's
forward, since a remap run early would put the remapper's state, and so a checkpoint, a batch
ahead. The forward of that very batch (the same SparseFeatures object) takes it; any other
forward (a validation batch, say) runs whole, as if nothing were held.

Nothing in an input dist or a remapper's send reads or writes a row or a remapper's state, so
holding a batch changes no number. What the input dist does fix early is which tables are
frozen (the exchange agrees on that): a table's `requires_grad` changed while a batch is in
flight is refused when that batch's forward comes. At most two batches are held: the current
one and the next. Over a disk tier, a held batch's rows are also read into the cache and pinned
(step/forward.py, `fetch`): its own slots, which the current step's update changes in place
where the batches share a row; dropping the batch unpins them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from manualpar.embeddings.config import BUILDER, EmbeddingBagConfig
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.ids.hashing import hash_raw_ids
from manualpar.embeddings.ids.managed_collisions import managed_per_sample
from manualpar.embeddings.ids.remap import RawIdRemap
from manualpar.embeddings.modules.bag_collection import FeatureCheck, check_features
from manualpar.embeddings.step.frozen import frozen_tables
from manualpar.embeddings.step.results import RoutedIds
from manualpar.embeddings.step.sharded_step import ShardedStep
from manualpar.errors import EmbeddingInputError
from manualpar.phase_times import IDS_EXCHANGE

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["BatchInputs", "InputShape", "PreparedBatch", "pooled_bags"]


@dataclass(frozen=True)
class PreparedBatch:
    """A batch ready for the lookup."""

    bags: SparseFeatures  # checked, on the device, hashed and remapped: what the step looks up
    routed: RoutedIds | None  # its input dist, if it ran ahead (a pipeline's prefetch)
    context: Any  # what the collection's output needs besides (InputShape's)


class InputShape(Protocol):
    """A collection's batch as the bags the step looks up: checked (EmbeddingInputError for a
    bad batch), and what the collection's output needs besides."""

    def __call__(self, features: SparseFeatures) -> tuple[SparseFeatures, Any]: ...


def pooled_bags(configs: Sequence[EmbeddingBagConfig]) -> InputShape:
    """A bag collection's input shape: the batch itself, checked against the tables."""
    check = FeatureCheck(configs)

    def shape(features: SparseFeatures) -> tuple[SparseFeatures, Any]:
        return check_features(features, check), None

    return shape


class _Settles(Protocol):
    """What travels for a held batch (RoutedIds, a remap's RemapSent)."""

    def settle(self) -> None: ...


@dataclass(frozen=True)
class _Held:
    key: SparseFeatures  # the batch as the caller passed it to prefetch
    ready: Callable[[], PreparedBatch]  # the rest of its preparation, at its forward
    settle: Callable[[], None]  # a dropped batch: wait for what travels, unpin its rows
    frozen: frozenset[int]  # this rank's frozen tables when its input dist ran


class BatchInputs:
    """Prepares a collection's batches, now (`prepare`) or a step ahead (`prefetch`)."""

    LIMIT = 2  # batches held: the one a pipeline handed out and the next

    def __init__(
        self,
        shape: InputShape,
        configs: Sequence[EmbeddingBagConfig],
        remap: RawIdRemap | None,
        step: ShardedStep,
        strategy: ManualParallelStrategy,
        tables: nn.ModuleDict,
    ) -> None:
        self.shape, self.configs, self.remap = shape, tuple(configs), remap
        self.step, self.strategy, self.tables = step, strategy, tables
        self.names = [config.name for config in configs]
        self._held: list[_Held] = []

    @property
    def holding(self) -> int:
        """Prefetched batches whose forward has not come yet (0, 1 or 2)."""
        return len(self._held)

    def prepare(self, features: SparseFeatures) -> PreparedBatch:
        """The batch for its lookup: the one prefetched if `features` is that very object."""
        held = self._take(features)
        with self._timed():  # the input dist's preparation
            if held is not None:
                return held.ready()
            bags, context = self._checked(features)
            if self.remap is not None:  # ManagedCollisions tables: raw ids to rows
                bags = self.remap(bags)
            return PreparedBatch(bags, None, context)

    def prefetch(self, features: SparseFeatures) -> None:
        """Prepare `features` and start its input dist now (collective: every rank prefetches
        its own next batch); over a disk tier, its rows are read into the cache too."""
        self._check_free()
        with self._timed():
            bags, context = self._checked(features)
            remap = self.remap
            if remap is not None and remap.exchanges:  # the remap waits for the forward
                sent = remap.send(bags)
                self._hold(features, lambda: PreparedBatch(remap.finish(sent), None, context), sent)
                return
        phases = self.step.forward_phases
        routed = phases.fetch(phases.input_dist(bags))
        self._hold(features, lambda: PreparedBatch(routed.features, routed, context), routed)

    def drop(self) -> None:
        """Forget the held batches: wait for their ids, unpin the rows read in ahead."""
        for held in self._held:
            held.settle()
        self._held = []

    def _checked(self, features: SparseFeatures) -> tuple[SparseFeatures, Any]:
        """Shaped and checked (a bad batch stops every rank), on the device, hashed; a batch
        per feature with its raw-id remapped features expanded (managed_per_sample)."""
        try:
            bags, context = self.shape(features)
        except EmbeddingInputError:
            self._refuse_step()
            raise
        bags = hash_raw_ids(bags.to(self.strategy.device), self.configs)
        if self.remap is not None:
            bags = managed_per_sample(bags, self.configs)
        return bags, context

    def _refuse_step(self) -> None:
        """Bad local batch: join the first exchange of the step with REFUSED sizes."""
        remap = self.remap
        if remap is not None and remap.exchanges:  # its exchange runs first: the others stop there
            remap.refuse()
            return
        if self.strategy.world_size > 1:
            self.step.refuse()

    def _timed(self) -> AbstractContextManager[None]:
        return self.step.phase_times.phase(IDS_EXCHANGE)

    # batches in flight -------------------------------------------------------------------------
    def _check_free(self) -> None:
        """Refuse a third batch before its input dist starts (the same on every rank)."""
        if len(self._held) >= self.LIMIT:
            raise EmbeddingInputError(
                f"{BUILDER}: prefetch() while {self.LIMIT} batches are in flight (the current "
                "one and the next): run the forward of the batches prefetched before (the same "
                "SparseFeatures objects you passed to prefetch, not copies such as "
                ".to(device)), or drop them (emb.drop_prefetched())"
            )

    def _hold(
        self, key: SparseFeatures, ready: Callable[[], PreparedBatch], sent: _Settles
    ) -> None:
        self._check_free()
        frozen = frozen_tables(self.tables, self.names)
        self._held.append(_Held(key, ready, sent.settle, frozen))

    def _take(self, key: SparseFeatures) -> _Held | None:
        """The held batch `key` is, or None (run it whole)."""
        found = next((h for h in self._held if h.key is key), None)
        if found is None:
            return None
        self._held.remove(found)
        now = frozen_tables(self.tables, self.names)
        if now != found.frozen:
            found.settle()  # nothing of it stays pinned
            changed = [self.names[t] for t in sorted(now ^ found.frozen)]
            raise EmbeddingInputError(
                f"{BUILDER}: the requires_grad of table(s) {changed} changed while this batch "
                "was in flight (its input dist, which fixes the frozen tables, ran before the "
                "change): change requires_grad between pipelines, not inside one, or drop the "
                "batches in flight first (emb.drop_prefetched())"
            )
        return found
