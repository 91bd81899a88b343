"""Data-parallel (replicated) tables: looked up locally, updated from an all-reduced gradient.

Such tables are small by construction (the planner replicates only tiny ones), so each rank
looks its own batch up in its full copy, and backward sums dense row gradients and touch counts
over the ranks (one all_reduce for all of them) before every copy applies the same update.
"""

from __future__ import annotations

import torch

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.kernels.bags import pooled_sum, row_gradients
from manualpar.embeddings.step.bag_expansion import FeatureBags, OutputGrad
from manualpar.embeddings.step.parts import StepParts

__all__ = ["DataParallelTables", "FeatureIds", "split_features"]

FeatureIds = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]  # per feature


def split_features(features: SparseFeatures) -> FeatureIds:
    """Per feature: its (ids, lengths, weights), one length per bag."""
    sizes = features.feature_sizes()
    values = features.values.split(sizes)
    lengths = features.lengths.split(features.bag_counts())
    weights = features.weights.split(sizes) if features.weights is not None else [None] * len(sizes)
    return [(values[f], lengths[f], weights[f]) for f in range(len(sizes))]


class DataParallelTables:
    """The forward and backward phases of a collection's replicated tables."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.tables = parts.routing.data_parallel

    def lookup(self, features: SparseFeatures, out: torch.Tensor, bags: FeatureBags) -> FeatureIds:
        """Write the replicated tables' pooled columns of `out` (each bag pooled once, then
        expanded to the batch); returns the per-feature ids backward needs (none without
        replicated tables)."""
        routing = self.parts.routing
        if not self.tables:
            return []
        feature_ids = split_features(features)
        for f, (_, t) in enumerate(routing.features):
            if t in self.tables:
                ids, lengths, weights = feature_ids[f]
                start = routing.feature_offsets[f]
                pooled = pooled_sum(self.parts.weight(t), ids, lengths, weights)
                out[:, start : start + routing.dims[f]] = bags.expand(f, pooled)
        return feature_ids

    def update(
        self,
        grad: OutputGrad,
        feature_ids: FeatureIds,
        my_scale: float,
        frozen: frozenset[int],
    ) -> None:
        """Sum the replicated tables' row gradients over the ranks and update every copy (frozen
        tables: neither)."""
        parts, routing = self.parts, self.parts.routing
        tables = [t for t in self.tables if t not in frozen]
        if not tables:
            return
        buffers = []
        for t in tables:
            config = routing.tables[t]
            dense = grad.grad.new_zeros(config.num_embeddings, config.embedding_dim + 1)
            for f, (_, ft) in enumerate(routing.features):
                if ft != t:
                    continue
                ids, lengths, weights = feature_ids[f]
                start = routing.feature_offsets[f]
                bag_grads = grad.columns(f, start, start + config.embedding_dim) * my_scale
                rows, summed = row_gradients(
                    ids, lengths, weights, bag_grads, config.num_embeddings
                )
                dense[rows, :-1] += summed
                dense[rows, -1] += 1
            buffers.append(dense)
        flat = torch.cat([b.flatten() for b in buffers])
        parts.strategy.all_reduce_(
            flat, "sum", name=f"{BUILDER}: data-parallel gradient all_reduce"
        )
        offset = 0
        for t, buffer in zip(tables, buffers, strict=True):
            dense = flat[offset : offset + buffer.numel()].view_as(buffer)
            offset += buffer.numel()
            rows = torch.nonzero(dense[:, -1]).flatten()
            parts.optimizer.update_rows(parts.name(t), parts.weight(t), rows, dense[rows, :-1])
