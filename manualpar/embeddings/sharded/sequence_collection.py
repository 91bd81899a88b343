"""Sequence (unpooled) embeddings on the sharded bag machinery: the pieces that
`ShardedEmbeddingCollection` (below, on the bag collection it extends) is made of.

An unpooled lookup is a sum-pooled lookup whose bags hold one id each. So a feature's n ids
become n bags of length one, padded with empty bags to the batch's largest feature (the bag
machinery has one batch size for every feature); the sharded bag collection's forward and
backward run unchanged (plans, routing, exchanges, the fused update, checkpoints, resharding),
and its (bags, total dim) output is cut back into each feature's first n rows. The padding rows
get a zero gradient, so the update sees exactly the ids' gradients.

The bag machinery weighs ranks by their bag counts under normalize_by="global_samples", which
here would be padded id counts: the sequence collection runs it with "world_size" (an average
over ranks) and multiplies each rank's output gradient by world size x its sample share.

The exchanges are compact (step/exchange.py, ExchangeLayout.compact): an owner sends back rows
only for the bags that have ids there, and receives gradients only for those, so a row-split
table returns each id's row from its owning block alone and the padding bags never travel.
What remains of the reuse, per step: a length (1 or 0) travels with each padded id slot, and
each rank's own lookup computes its padding rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from manualpar.eager import eager_only
from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.modules.sequence_collection import (
    EmbeddingCollection,
    JaggedEmbeddings,
    SequenceEmbeddings,
    check_sequence_features,
)
from manualpar.embeddings.optim.update_rules import SparseOptimizer
from manualpar.embeddings.plan import EmbeddingPlan
from manualpar.embeddings.sharded.bag_collection import ShardedEmbeddingBagCollection
from manualpar.embeddings.sharded.managed_collisions import RemapInFlight
from manualpar.embeddings.step.routing import Routing
from manualpar.embeddings.step.table_mesh import TableMesh
from manualpar.embeddings.storage.disk_tier import DiskTier
from manualpar.errors import EmbeddingInputError

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = [
    "ShardedEmbeddingCollection",
    "sample_share",
    "scale_gradient",
    "split_rows",
    "unit_bags",
]


def unit_bags(features: SparseFeatures) -> tuple[SparseFeatures, list[int]]:
    """The same ids, each its own bag: feature f gets counts[f] bags of length 1, then empty
    bags up to the largest count (every feature has the same number of bags). Returns the bags
    and the counts."""
    counts = features.feature_sizes()
    device = features.values.device
    bags = max(counts, default=0)
    ones = torch.arange(bags, device=device) < torch.tensor(counts, device=device).unsqueeze(1)
    return SparseFeatures(features.keys, features.values, ones.to(torch.int64).flatten()), counts


def split_rows(
    pooled: torch.Tensor, features: SparseFeatures, counts: list[int], routing: Routing
) -> SequenceEmbeddings:
    """Each feature's rows (its first counts[f] bags, its columns) with the batch's lengths."""
    batch = features.batch_size
    out = {}
    for f, (name, _) in enumerate(routing.features):
        start = routing.feature_offsets[f]
        out[name] = JaggedEmbeddings(
            pooled[: counts[f], start : start + routing.dims[f]],
            features.lengths[f * batch : (f + 1) * batch],
        )
    return SequenceEmbeddings(out)


def sample_share(strategy: ManualParallelStrategy, batch: int) -> float:
    """world size x this rank's share of the global samples: with the machinery's average over
    ranks (1 / world size), this factor weighs this rank's loss by its sample share, as
    `ddp(normalize_by="global_samples")`. One all_reduce of one number."""
    total = torch.tensor([float(batch)], dtype=torch.float64, device=strategy.device)
    strategy.all_reduce_(total, "sum", name=f"{BUILDER}: sample count all_reduce")
    whole = float(total)
    return strategy.world_size * batch / whole if whole else 0.0


def scale_gradient(values: torch.Tensor, factor: float) -> torch.Tensor:
    """`values` unchanged, its gradient multiplied by `factor`."""
    out: torch.Tensor = _ScaleGradient.apply(values, factor)
    return out


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return values.view_as(values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class ShardedEmbeddingCollection(ShardedEmbeddingBagCollection):
    """`shard_embeddings` of an EmbeddingCollection: the bag collection above with one id per
    bag (unit_bags above); forward returns SequenceEmbeddings, the rest is the same."""

    def __init__(
        self,
        ec: EmbeddingCollection,
        strategy: ManualParallelStrategy,
        plan: EmbeddingPlan,
        optimizer: SparseOptimizer,
        normalize_by: str,
        layout: TableMesh | None = None,
        disk_tier: DiskTier | None = None,
        non_finite: str = "raise",
    ) -> None:
        super().__init__(ec, strategy, plan, optimizer, "world_size", layout, disk_tier, non_finite)
        self.normalize_by = normalize_by
        self.step.forward_phases.warn_uneven = False  # its bag counts are padded id counts

    @eager_only(f"{BUILDER}: the table exchange runs eagerly")
    def forward(  # type: ignore[override]  # the same machinery, another output type
        self, features: SparseFeatures
    ) -> SequenceEmbeddings:
        taken = self._in_flight.take(features)  # this very batch's ids, if prefetched
        if taken is not None:
            routed, counts = taken
            features = features.to(self.strategy.device)
            if isinstance(routed, RemapInFlight):  # raw ids sent ahead: remap them now
                pooled = self._lookup(self._remapped(routed), None)
            else:
                pooled = self._lookup(routed.features, routed)
        else:
            features, bags, counts = self._unit(features)
            pooled = super().forward(bags).values
        if self.normalize_by == "global_samples":
            pooled = scale_gradient(pooled, sample_share(self.strategy, features.batch_size))
        return split_rows(pooled, features, counts, self.routing)

    def _unit(self, features: SparseFeatures) -> tuple[SparseFeatures, SparseFeatures, list[int]]:
        """Checked (a bad batch stops every rank), on the device, and as one bag per id."""
        try:
            features = check_sequence_features(features, self.configs)
        except EmbeddingInputError:
            self._refuse_step()
            raise
        features = features.to(self.strategy.device)
        bags, counts = unit_bags(features)
        return features, bags, counts

    def prefetch(self, features: SparseFeatures) -> None:
        """As the bag collection's: this batch's ids start travelling now (collective); raw
        ids of ManagedCollisions tables to their remappers."""
        self._in_flight.check_free()
        _, bags, counts = self._unit(features)
        checked = self._checked(bags)
        if self.raw_id_remap is not None and self.raw_id_remap.exchanges:
            self._in_flight.hold(features, self.raw_id_remap.send(checked), counts)
            return
        self._hold(features, checked, counts)
