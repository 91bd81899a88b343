"""What each phase of a sharded step hands the next (forward.py, backward.py).

Forward: input dist -> RoutedIds -> lookup -> LookedUp -> output dist -> (pooled output,
SavedForBackward). Backward: gradient dist -> RoutedGradients -> update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.kernels.bags import ShardBags
from manualpar.embeddings.kernels.table_batch import TableBatch
from manualpar.embeddings.step.bag_expansion import FeatureBags, OutputGrad
from manualpar.embeddings.step.data_parallel import FeatureIds
from manualpar.embeddings.step.exchange import Kept, SenderBags
from manualpar.embeddings.step.wire import Arriving
from manualpar.embeddings.storage.tier import Pins, TableStores

if TYPE_CHECKING:
    from manualpar.embeddings.step.finite_check import Flags
    from manualpar.strategy import PendingCollective

__all__ = ["FetchedRows", "LookedUp", "RoutedGradients", "RoutedIds", "SavedForBackward"]


@dataclass(frozen=True)
class FetchedRows:
    """A batch's bags as slots, mapped a step early (a pipeline's prefetch over a disk tier:
    its rows read into the cache and pinned until its step's backward)."""

    senders: list[list[SenderBags]]  # per sender rank, per routed local shard: slots
    pins: Pins
    stores: TableStores

    def release(self) -> None:
        """Unpin them (a dropped batch: its step never ran)."""
        self.stores.release(self.pins, updated=False)


@dataclass(frozen=True)
class RoutedIds:
    """A batch after input dist: sizes agreed, this rank's own bags packed, the bags for the
    other owners in flight."""

    features: SparseFeatures  # this rank's batch, on the step's device
    lengths: torch.Tensor  # (features, batch) length of the bag each sample reads
    sizes: list[list[int]]  # per shard-group rank: [batch, payload length, weighted]
    # this rank's payload to itself (exchange.py's layout: bag lengths, then ids, then weight
    # bits), read by the lookup in place (the table batch) or cut into its shards' bags
    own_payload: torch.Tensor
    ids_in: PendingCollective  # the other ranks' bags for our shards
    frozen: frozenset[int]  # tables every rank froze for this step
    job_batches: list[int]  # every job rank's batch size
    bags: FeatureBags  # each feature's bags of our batch, and how samples read them
    # compact layouts: per owner, per route, the bags of our batch with ids there
    kept: Kept = None
    fetched: FetchedRows | None = None  # its slots, if mapped ahead (ForwardPhases.fetch)

    @property
    def batch(self) -> int:
        return self.features.batch_size

    def settle(self) -> None:
        """Wait for the ids in flight and unpin any slots mapped ahead (a dropped batch)."""
        self.ids_in.wait()
        if self.fetched is not None:
            self.fetched.release()


@dataclass(frozen=True)
class LookedUp:
    """A batch after lookup: its own pooled rows in `out`, the others' on their way back."""

    routed: RoutedIds
    out: torch.Tensor  # (batch, total dim): this rank's own shards' partial sums so far
    bags: list[ShardBags]  # per local shard: every sender's bags (slots), in rank order
    pooled_in: Arriving | None  # pooled rows from the other owners (None alone)
    pins: Pins  # slots held until backward (or release on a failed or gradient-free step)
    bag_counts: list[list[int]]  # per local shard, per sender: its bags here (gradient rows)
    # every shard's bags in one batch (batched_tables.py; then `bags` is empty), or None
    batch: TableBatch | None = None
    # `out` left unfilled: the pooled rows are copied in (ExchangeLayout.fills_output)
    fills: bool = False


@dataclass(frozen=True)
class SavedForBackward:
    """What forward keeps for backward: one per step."""

    bags: list[ShardBags]
    batch_sizes: list[int]  # per shard-group rank
    scales: list[float]  # each sender's weight in the table gradient
    feature_ids: FeatureIds  # per feature, for the data-parallel tables
    mean_scale: torch.Tensor | None  # (batch, total dim) 1/len factors of mean pooling
    frozen: frozenset[int]
    trains: bool  # False: every table frozen, no backward
    pins: Pins
    bag_counts: list[list[int]]  # LookedUp's: the gradient rows each sender sends us
    kept: Kept  # RoutedIds': the gradient rows we send
    batch: TableBatch | None = None  # LookedUp's
    feature_bags: FeatureBags | None = None  # RoutedIds' bags (None: one per sample)


@dataclass(frozen=True)
class RoutedGradients:
    """A step's output gradient after gradient dist: this rank's own blocks cut out, the
    others' on their way to their owners."""

    grad: torch.Tensor  # the output gradient (mean pooling applied)
    own: list[list[torch.Tensor]]  # per local shard: our own bags' gradient blocks
    grads_in: Arriving | None  # the other ranks' gradients for our shards
    non_finite: Flags  # the job's non-finite flags (finite_check.py)
    by_bag: OutputGrad | None = None  # `grad` over each feature's bags (None: `grad` is)
