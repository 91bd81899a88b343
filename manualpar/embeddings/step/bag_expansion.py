"""A batch per feature in the step: each distinct bag travels and is looked up once.

A feature of a variable batch (SparseFeatures.bags_per_key, inverse_indices) sends its own bags
to their owners, who pool them as any others; the requesting rank expands the pooled rows to
the batch after the exchange (index_select by the inverse indices) and, in backward, sums the
expanded gradient back onto the bags (index_add) before it travels. So repeated ids neither
travel nor are looked up again, and the owners see bags, never samples. A feature whose inverse
is the identity (one bag per sample, in order) is left as it is, and a batch without any other
goes through the step as a plain one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.step.routing import Routing

__all__ = ["FeatureBags", "OutputGrad", "bag_lengths", "route_sums"]


@dataclass(frozen=True)
class FeatureBags:
    """This rank's bags per routed feature, and the bag each sample reads where it is not one
    bag per sample."""

    batch: int  # samples
    counts: tuple[int, ...]  # per feature (the routing's order): bags of this rank's batch
    inverse: tuple[torch.Tensor | None, ...]  # per feature: (batch,) bag indices, or None
    # whether any feature has bags of its own (else the step runs as for a plain batch): read
    # several times a step, so found once
    variable: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "variable", any(row is not None for row in self.inverse))

    @classmethod
    def of(cls, features: SparseFeatures) -> FeatureBags:
        """`features` (in the routing's feature order): its features' bags; one host read for
        a variable batch (which features are one bag per sample)."""
        batch, counts = features.batch_size, tuple(features.bag_counts())
        indices = features.inverse_indices
        if indices is None:
            return cls(batch, counts, (None,) * len(counts))
        identity = torch.arange(batch, device=indices.device)
        plain = (indices == identity).all(1).tolist() if batch else [True] * len(counts)
        inverse = tuple(
            None if plain[f] and counts[f] == batch else indices[f] for f in range(len(counts))
        )
        return cls(batch, counts, inverse)

    def expand(self, feature: int, rows: torch.Tensor) -> torch.Tensor:
        """(bags, cols) pooled rows of `feature` -> (batch, cols), a row per sample."""
        inverse = self.inverse[feature]
        return rows if inverse is None else rows.index_select(0, inverse)

    def sum_back(self, feature: int, grad: torch.Tensor) -> torch.Tensor:
        """(batch, cols) gradient of `feature`'s expanded rows -> (bags, cols), each bag's the
        sum over the samples that read it (the gradient of `expand`)."""
        inverse = self.inverse[feature]
        if inverse is None:
            return grad
        summed = grad.new_zeros(self.counts[feature], grad.shape[1])
        return summed.index_add_(0, inverse, grad)

    def sample_lengths(self, lengths: list[torch.Tensor]) -> torch.Tensor:
        """(features, batch) bag lengths per sample, from each feature's bag lengths (for mean
        pooling, whose 1/len scales the expanded rows)."""
        return (
            torch.stack(
                [
                    bags if inverse is None else bags.index_select(0, inverse)
                    for bags, inverse in zip(lengths, self.inverse, strict=True)
                ]
            )
            if lengths
            else torch.zeros(0, self.batch, dtype=torch.int64)
        )


@dataclass
class OutputGrad:
    """A step's output gradient as the owners read it: each feature's columns over its bags
    (summed back once per feature, where it has bags of its own)."""

    grad: torch.Tensor  # (batch, total dim), mean pooling applied
    routing: Routing
    bags: FeatureBags | None = None  # None: one bag per sample for every feature
    _summed: dict[int, torch.Tensor] = field(default_factory=dict)

    def columns(self, feature: int, start: int, end: int) -> torch.Tensor:
        """The gradient of `feature`'s bags in output columns [start, end)."""
        bags = self.bags
        if bags is None or bags.inverse[feature] is None:
            return self.grad[:, start:end]
        base = self.routing.feature_offsets[feature]
        if feature not in self._summed:
            dim = self.routing.dims[feature]
            self._summed[feature] = bags.sum_back(feature, self.grad[:, base : base + dim])
        return self._summed[feature][:, start - base : end - base]


def route_sums(lens: torch.Tensor, counts: list[int]) -> list[int]:
    """The ids of each route of a payload: the sum of its `counts[r]` bag lengths (one host
    read)."""
    if not counts:
        return []
    if len(set(counts)) == 1:  # one bag per sample for every route: a plain batch
        sums: list[int] = lens.view(len(counts), counts[0]).sum(1).tolist()
        return sums
    route = torch.repeat_interleave(
        torch.arange(len(counts), device=lens.device),
        torch.tensor(counts, device=lens.device),
    )
    return (
        torch.zeros(len(counts), dtype=lens.dtype, device=lens.device)
        .index_add_(0, route, lens)
        .tolist()
    )


def bag_lengths(
    features: SparseFeatures, bags: FeatureBags
) -> tuple[list[torch.Tensor] | torch.Tensor, torch.Tensor]:
    """Each feature's bag lengths (what travels; a plain batch: the rows of its (features,
    batch) grid, not cut here: whole features travel as slices of the batch), and the
    (features, batch) length of the bag each sample reads (for mean pooling)."""
    if not bags.variable:  # one bag per sample everywhere: the same (features, batch) grid
        grid = features.lengths.view(len(bags.counts), bags.batch)
        return grid, grid
    per_feature = list(features.lengths.split(list(bags.counts)))
    return per_feature, bags.sample_lengths(per_feature)
