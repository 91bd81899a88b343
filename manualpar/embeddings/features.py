"""SparseFeatures: a jagged batch of categorical ids, one bag of ids per (feature, sample).

Layout (the one TorchRec and FBGEMM use, so data converts without copies): `values` holds every
id, feature-major (all bags of the first key, then the second key, ...); `lengths[f * B + b]` is
the number of ids in bag b of feature f. Optional `weights` hold one float per id (weighted
pooling). The batch is validated when built (feature_checks.py), so a malformed batch fails
here, naming the feature, and not later inside a collective; the validation runs eagerly even
when the batch is built inside a torch.compile'd function.

A feature may hold its own number of bags (a deduplicated user feature: one bag per request,
read by each of its item rows): `bags_per_key` gives each key's bag count, `lengths` one length
per bag, and `inverse_indices[f, b]` the bag sample b reads (variable_batch.py). The sharded
step looks each bag up once and expands the pooled rows after the exchange.

TorchRec's KeyedJaggedTensor has the same layout: `from_kjt` reads one (or any object with its
methods, its variable-stride form too) and `to_kjt` builds one, sharing the tensors; TorchRec is
imported only by `to_kjt`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from manualpar.embeddings.feature_checks import validate_features
from manualpar.embeddings.kjt_form import build_kjt, lengths_of_offsets, read_kjt
from manualpar.embeddings.variable_batch import (
    bag_starts,
    expand_bags,
    inverse_rows,
    unread_emptied,
)
from manualpar.errors import EmbeddingInputError

__all__ = ["JaggedFeature", "SparseFeatures"]


@dataclass(frozen=True)
class JaggedFeature:
    """The bags of one feature: ids, lengths (one per bag) and optional per-id weights; with
    `inverse_indices`, the bag each sample reads (else one bag per sample)."""

    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None
    inverse_indices: torch.Tensor | None = None

    def offsets(self) -> torch.Tensor:
        return _offsets(self.lengths)

    def to_lists(self) -> list[list[int]]:
        return [bag.tolist() for bag in torch.split(self.values, self.lengths.tolist())]


@dataclass(frozen=True)
class SparseFeatures:
    """A batch of ids: `keys`, then every bag's ids feature-major in `values`, one length per
    (key, sample) in `lengths`, optional per-id `weights`; validated when built. A batch per
    feature: `bags_per_key` (each key's bags, `lengths` one per bag) and `inverse_indices`
    ((keys, batch): the bag each sample reads), both or neither."""

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None
    bags_per_key: tuple[int, ...] | None = None
    inverse_indices: torch.Tensor | None = None
    _sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        if self.bags_per_key is not None:
            object.__setattr__(self, "bags_per_key", tuple(self.bags_per_key))
        sizes = validate_features(self)
        object.__setattr__(self, "values", self.values.to(torch.int64))
        object.__setattr__(self, "lengths", self.lengths.to(torch.int64))
        if self.inverse_indices is not None:
            object.__setattr__(self, "inverse_indices", self.inverse_indices.to(torch.int64))
        # Each key's id count, read once here (validation reads the lengths anyway), so that
        # slicing a feature out needs no host read: eager saves a sync per slice, and
        # torch.compile traces `batch[key]` and `select` without a graph break.
        object.__setattr__(self, "_sizes", tuple(sizes))

    @classmethod
    def _checked(
        cls,
        keys: tuple[str, ...],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        sizes: tuple[int, ...],
        bags_per_key: tuple[int, ...] | None = None,
        inverse_indices: torch.Tensor | None = None,
    ) -> SparseFeatures:
        """A batch made of parts of a validated one (int64 tensors, sizes known): skips the
        validation, whose host reads would break a compiled caller's graph."""
        batch = object.__new__(cls)
        for name, value in (
            ("keys", keys),
            ("values", values),
            ("lengths", lengths),
            ("weights", weights),
            ("bags_per_key", bags_per_key),
            ("inverse_indices", inverse_indices),
            ("_sizes", sizes),
        ):
            object.__setattr__(batch, name, value)
        return batch

    # construction -----------------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls,
        bags: Mapping[str, Sequence[Sequence[int]]],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
        inverse_indices: Mapping[str, Sequence[int]] | None = None,
    ) -> SparseFeatures:
        """From Python lists: {"user": [[1, 2], [], [7]], "item": [[3], [4], [5, 6]]}.
        `inverse_indices`: for the features with their own bag count, the bag each sample reads
        ({"user": [0, 0, 1]} with "user": [[1, 2], [7]]); the others hold one bag per sample."""
        keys = tuple(bags)
        sizes = {key: len(b) for key, b in bags.items()}
        inverse = None if inverse_indices is None else inverse_rows(keys, sizes, inverse_indices)
        if inverse is None and len(set(sizes.values())) > 1:
            raise EmbeddingInputError(
                f"every feature needs one bag per sample, got bag counts {sizes}; "
                "use an empty list for a sample without ids, or give the features with their "
                "own bag count inverse_indices"
            )
        if weights is not None and set(weights) != set(keys):
            raise EmbeddingInputError(
                f"weights must be given for exactly the features {sorted(keys)}, "
                f"got {sorted(weights)}"
            )
        values = [i for key in keys for bag in bags[key] for i in bag]
        lengths = [len(bag) for key in keys for bag in bags[key]]
        weight_values = None
        if weights is not None:
            for key in keys:
                if [len(b) for b in weights[key]] != [len(b) for b in bags[key]]:
                    raise EmbeddingInputError(
                        f"feature {key!r}: weights must have the same bag sizes as the ids"
                    )
            weight_values = torch.tensor(
                [w for key in keys for bag in weights[key] for w in bag], dtype=torch.float32
            )
        return cls(
            keys,
            torch.tensor(values, dtype=torch.int64),
            torch.tensor(lengths, dtype=torch.int64),
            weight_values,
            None if inverse is None else tuple(sizes.values()),
            inverse,
        )

    @classmethod
    def from_offsets(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> SparseFeatures:
        """From offsets (len(keys) * B + 1 entries, starting at 0) instead of lengths."""
        return cls(tuple(keys), values, lengths_of_offsets(offsets), weights)

    @classmethod
    def from_kjt(cls, kjt: Any) -> SparseFeatures:
        """From a TorchRec KeyedJaggedTensor, or any object with its methods (duck typing, so
        TorchRec need not be installed): keys(), values(), lengths() or offsets(), and
        weights_or_none(); a variable stride per key (variable_stride_per_key() true) also
        stride_per_key_per_rank() and inverse_indices_or_none(). The tensors are shared when
        they are already int64."""
        return cls(*read_kjt(kjt))

    @classmethod
    def from_features(cls, features: Mapping[str, JaggedFeature]) -> SparseFeatures:
        """Concatenate per-feature bags (all with the same number of samples; a feature with
        inverse_indices may hold its own number of bags)."""
        keys = tuple(features)
        parts = list(features.values())
        weighted = [p.weights is not None for p in parts]
        if any(weighted) and not all(weighted):
            raise EmbeddingInputError("either every feature has weights or none does")
        inverse = None
        if any(p.inverse_indices is not None for p in parts):
            rows = {
                k: p.inverse_indices.tolist()
                for k, p in features.items()
                if p.inverse_indices is not None
            }
            inverse = inverse_rows(keys, {k: p.lengths.numel() for k, p in features.items()}, rows)
        return cls(
            keys,
            torch.cat([p.values for p in parts]) if parts else torch.empty(0),
            torch.cat([p.lengths for p in parts]) if parts else torch.empty(0),
            torch.cat([p.weights for p in parts if p.weights is not None])
            if all(weighted) and parts
            else None,
            None if inverse is None else tuple(p.lengths.numel() for p in parts),
            inverse,
        )

    # views ------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Samples in the batch (with a batch per feature: the inverse indices' columns)."""
        if self.inverse_indices is not None:
            return self.inverse_indices.shape[1]
        return self.lengths.numel() // len(self.keys) if self.keys else 0

    @property
    def variable_batch(self) -> bool:
        """Whether the features hold their own numbers of bags (inverse_indices expand them)."""
        return self.inverse_indices is not None

    def bag_counts(self) -> list[int]:
        """Number of bags of each key (the batch size for each, unless variable_batch)."""
        if self.bags_per_key is not None:
            return list(self.bags_per_key)
        return [self.batch_size] * len(self.keys)

    def offsets(self) -> torch.Tensor:
        return _offsets(self.lengths)

    def feature_sizes(self) -> list[int]:
        """Number of ids of each key."""
        return list(self._sizes)

    def __getitem__(self, key: str) -> JaggedFeature:
        if key not in self.keys:
            raise EmbeddingInputError(f"no feature {key!r} in this batch; it has {list(self.keys)}")
        index = self.keys.index(key)
        starts = bag_starts(self.bag_counts())
        start = sum(self._sizes[:index])
        end = start + self._sizes[index]
        lengths = self.lengths[starts[index] : starts[index + 1]]
        weights = None if self.weights is None else self.weights[start:end]
        inverse = None if self.inverse_indices is None else self.inverse_indices[index]
        return JaggedFeature(self.values[start:end], lengths, weights, inverse)

    def to_dict(self) -> dict[str, JaggedFeature]:
        return {key: self[key] for key in self.keys}

    def to(self, device: torch.device | str) -> SparseFeatures:
        """Itself where every tensor is on `device` (as Tensor.to), else moved unvalidated:
        moving changes no id (validating again cost about 0.2 ms of a 26-feature step)."""
        values, lengths = self.values.to(device), self.lengths.to(device)
        weights = None if self.weights is None else self.weights.to(device)
        inverse = None if self.inverse_indices is None else self.inverse_indices.to(device)
        now = (self.values, self.lengths, self.weights, self.inverse_indices)
        if all(a is b for a, b in zip((values, lengths, weights, inverse), now, strict=True)):
            return self
        args = (self.keys, values, lengths, weights, self._sizes, self.bags_per_key, inverse)
        return SparseFeatures._checked(*args)

    def with_values(self, values: torch.Tensor) -> SparseFeatures:
        """The same bags holding other ids (one per id, e.g. raw ids hashed to rows)."""
        if values.shape != self.values.shape:
            raise EmbeddingInputError(
                f"with_values() takes one id per id of the batch, shape "
                f"{tuple(self.values.shape)}, got {tuple(values.shape)}"
            )
        same = (self.lengths, self.weights, self._sizes, self.bags_per_key, self.inverse_indices)
        return SparseFeatures._checked(self.keys, values.to(torch.int64), *same)

    def expand(self, keys: Sequence[str] | None = None) -> SparseFeatures:
        """The batch with one bag per (key, sample): each sample's bag copied out of its
        feature's bags (itself if not variable_batch). What a variable batch stands for.
        `keys`: only those features (the others keep their own bags)."""
        inverse = self.inverse_indices
        chosen = set(self.keys) if keys is None else set(self.keys) & set(keys)
        if inverse is None or not chosen:
            return self
        parts = [(key, self[key], row) for key, row in zip(self.keys, inverse, strict=True)]
        expanded = [
            expand_bags(p.values, p.lengths, p.weights, row)
            if key in chosen
            else (p.values, p.lengths, p.weights)
            for key, p, row in parts
        ]
        weights = [w for _, _, w in expanded if w is not None]
        bags: tuple[int, ...] | None = None
        if len(chosen) < len(self.keys):  # the others keep their bags
            bags = tuple(n.numel() for _, n, _ in expanded)
            identity = torch.arange(self.batch_size, device=inverse.device)
            inverse = torch.stack([identity if k in chosen else r for k, _, r in parts])
        return SparseFeatures(
            self.keys,
            torch.cat([v for v, _, _ in expanded]),
            torch.cat([n for _, n, _ in expanded]),
            torch.cat(weights) if self.weights is not None else None,
            bags,
            None if bags is None else inverse,
        )

    def without_unread_bags(self) -> SparseFeatures:
        """The batch with the bags no sample reads emptied (itself if every bag is read): their
        ids would be looked up and their rows touched by the update (Adam steps a touched row
        even with a zero gradient) for no sample of the batch it stands for."""
        if self.inverse_indices is None or self.bags_per_key is None:
            return self
        emptied = unread_emptied(
            self.values, self.lengths, self.weights, self.bags_per_key, self.inverse_indices
        )
        if emptied is None:
            return self
        return SparseFeatures(self.keys, *emptied, self.bags_per_key, self.inverse_indices)

    def select(self, keys: Sequence[str]) -> SparseFeatures:
        """The same batch with only `keys`, in that order (a key named twice is kept once)."""
        keys = tuple(dict.fromkeys(keys))
        parts = [self[key] for key in keys]
        if not parts:
            return SparseFeatures._checked((), self.values[:0], self.lengths[:0], None, ())
        weighted = [p.weights for p in parts if p.weights is not None]
        weights = torch.cat(weighted) if self.weights is not None else None
        inverse = None
        if self.inverse_indices is not None:
            at = [self.keys.index(key) for key in keys]
            rows = torch.tensor(at, device=self.inverse_indices.device)
            inverse = self.inverse_indices.index_select(0, rows)
        return SparseFeatures._checked(
            keys,
            torch.cat([p.values for p in parts]),
            torch.cat([p.lengths for p in parts]),
            weights,
            tuple(self._sizes[self.keys.index(key)] for key in keys),
            None if inverse is None else tuple(p.lengths.numel() for p in parts),
            inverse,
        )

    def to_kjt(self) -> Any:
        """This batch as a TorchRec `KeyedJaggedTensor` sharing its tensors (TorchRec is imported
        here, and only here; ImportError says how to get it when it is missing)."""
        fields = (self.keys, self.values, self.lengths, self.weights)
        return build_kjt((*fields, self.bags_per_key, self.inverse_indices), self.batch_size)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets
