"""Sequence (unpooled) embeddings on the sharded bag machinery: `ShardedEmbeddingCollection`,
the parts of ShardedTables (sharded/sharded_tables.py) with an input shape and an output of its
own.

An unpooled lookup is a sum-pooled lookup whose bags hold one id each. So a feature's n ids
become n bags of length one, padded with empty bags to the batch's largest feature (the bag
machinery has one batch size for every feature); the sharded bag machinery's forward and
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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from manualpar.eager import eager_only
from manualpar.embeddings.config import BUILDER, EmbeddingBagConfig
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.modules.bag_collection import FeatureCheck
from manualpar.embeddings.modules.sequence_collection import (
    EmbeddingCollection,
    JaggedEmbeddings,
    SequenceEmbeddings,
    check_sequence_features,
)
from manualpar.embeddings.optim.update_rules import UpdateRule
from manualpar.embeddings.plan import EmbeddingPlan
from manualpar.embeddings.sharded.sharded_tables import ShardedTables
from manualpar.embeddings.step.routing import Routing
from manualpar.embeddings.step.table_mesh import TableMesh
from manualpar.embeddings.storage.disk_tier import DiskTier

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
    blocks = [
        (counts[f], routing.feature_offsets[f], routing.dims[f])
        for f in range(len(routing.features))
    ]
    if torch.is_grad_enabled() and pooled.requires_grad:
        rows = _FeatureRows.apply(pooled, blocks)
    else:
        rows = [pooled[:count, start : start + dim] for count, start, dim in blocks]
    return SequenceEmbeddings(
        {
            name: JaggedEmbeddings(rows[f], features.lengths[f * batch : (f + 1) * batch])
            for f, (name, _) in enumerate(routing.features)
        }
    )


class _FeatureRows(torch.autograd.Function):
    """Each feature's rows of the pooled output, copied out by one autograd node whose backward
    writes every feature's gradient into one buffer of the pooled shape. A slice per feature
    instead gave each feature a zero-filled gradient of the whole output, added into the
    others': 2 writes of the output per feature, a third of a 200k-row sequence step."""

    @staticmethod
    def forward(
        ctx: Any, pooled: torch.Tensor, blocks: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, ...]:
        ctx.blocks, ctx.shape = blocks, pooled.shape
        ctx.set_materialize_grads(False)  # an unused feature's gradient: None, not zeros
        return tuple(pooled[:count, start : start + dim].clone() for count, start, dim in blocks)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        given = next((g for g in grads if g is not None), None)
        if given is None:
            return None, None
        out = given.new_empty(ctx.shape)  # the blocks tile its columns (cumulative offsets)
        for (count, start, dim), grad in zip(ctx.blocks, grads, strict=True):
            block = out[:, start : start + dim]
            if grad is None:
                block.zero_()
                continue
            block[:count].copy_(grad)
            block[count:].zero_()  # padding bags: no id, no gradient
        return out, None


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


class ShardedEmbeddingCollection(ShardedTables):
    """`shard_embeddings` of an EmbeddingCollection: ShardedTables with one id per bag
    (unit_bags above); forward returns SequenceEmbeddings, the rest is as a bag collection's."""

    def __init__(
        self,
        ec: EmbeddingCollection,
        strategy: ManualParallelStrategy,
        plan: EmbeddingPlan,
        rule: UpdateRule,
        normalize_by: str,
        layout: TableMesh | None = None,
        disk_tier: DiskTier | None = None,
        non_finite: str = "raise",
    ) -> None:
        super().__init__(
            ec,
            strategy,
            plan,
            rule,
            normalize_by,
            layout,
            disk_tier,
            non_finite,
            shape=_UnitBags(ec.configs, strategy.device),
            step_normalize_by="world_size",  # the sample share is applied here (forward)
            compact_bags=True,  # bags hold one id each: exchange only those with ids
            warn_uneven=False,  # its bag counts are padded id counts, not samples
        )

    @eager_only(f"{BUILDER}: the table exchange runs eagerly")
    def forward(self, features: SparseFeatures) -> SequenceEmbeddings:
        batch = self.inputs.prepare(features)
        features, counts = batch.context
        pooled = self.lookup(batch)
        if self.normalize_by == "global_samples":
            pooled = scale_gradient(pooled, sample_share(self.strategy, features.batch_size))
        return split_rows(pooled, features, counts, self.routing)


class _UnitBags:
    """The input shape (batch_inputs.py): checked, on the device, one bag per id; the
    batch's features (on the device) and id counts for the output."""

    def __init__(self, configs: Sequence[EmbeddingBagConfig], device: torch.device) -> None:
        self.configs, self.device = configs, device
        self.check = FeatureCheck(configs)

    def __call__(
        self, features: SparseFeatures
    ) -> tuple[SparseFeatures, tuple[SparseFeatures, list[int]]]:
        features = check_sequence_features(features, self.check).to(self.device)
        bags, counts = unit_bags(features)
        return bags, (features, counts)
