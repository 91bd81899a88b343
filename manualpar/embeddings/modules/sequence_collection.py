"""EmbeddingCollection: tables looked up by sparse features, one row per id (no pooling).

The input to attention over a user's history: each feature's ids come back as a jagged batch of
rows, `out["history"].values` (ids, dim) with the batch's lengths. Unsharded, it is a plain
module (torch sparse gradients, trained by torch's SGD, Adagrad or SparseAdam): the
single-process reference. `shard_embeddings` shards it like an EmbeddingBagCollection
(sharded/sequence_collection.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.ids.hashing import hash_raw_ids
from manualpar.embeddings.ids.managed_collisions import managed_remapper
from manualpar.embeddings.kernels.rounding import accumulation_dtype
from manualpar.embeddings.modules.bag_collection import (
    FeatureCheck,
    check_features,
    make_tables,
    table_of,
)
from manualpar.embeddings.modules.table_record import TableRecords
from manualpar.errors import EmbeddingInputError

__all__ = [
    "EmbeddingCollection",
    "EmbeddingConfig",
    "JaggedEmbeddings",
    "SequenceEmbeddings",
    "check_sequence_features",
]


@dataclass(frozen=True)
class EmbeddingConfig(EmbeddingBagConfig):
    """A table for unpooled lookups: EmbeddingBagConfig's fields without `pooling`.

    It is an EmbeddingBagConfig whose pooling is "sum" because that is how the sharded
    collection computes it (each id a bag of its own, see sharded/sequence_collection.py):
    plans, the planner, `describe` and the initial values treat both kinds of table alike.
    """

    pooling: str = field(default="sum", init=False, repr=False)


@dataclass(frozen=True)
class JaggedEmbeddings:
    """One feature's rows: `values` (ids, dim), one row per id in the batch's order, and
    `lengths` (batch,), the ids of each sample. `values` may be a strided view (sharded
    output): use `reshape`, not `view`."""

    values: torch.Tensor
    lengths: torch.Tensor

    def offsets(self) -> torch.Tensor:
        """(batch + 1,) where each sample's rows start, then the number of rows."""
        offsets = self.lengths.new_zeros(self.lengths.numel() + 1)
        torch.cumsum(self.lengths, 0, out=offsets[1:])
        return offsets

    def split(self) -> list[torch.Tensor]:
        """One (length, dim) tensor per sample."""
        return list(torch.split(self.values, self.lengths.tolist()))

    def to_padded(self, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, length, dim) rows, zero after each sample's last id, and the (batch, length)
        bool mask, True at real ids. `length` defaults to the longest sample; a sample with
        more ids keeps its first `length`. Differentiable.

        The mask is the opposite of torch's `key_padding_mask` (nn.MultiheadAttention,
        nn.TransformerEncoder), where True means padding to ignore: pass
        `src_key_padding_mask=~mask`."""
        batch, dim = self.lengths.numel(), self.values.shape[1]
        longest = int(self.lengths.max()) if batch else 0
        length = longest if length is None else length
        if length < 0:
            raise EmbeddingInputError(f"to_padded: length must be >= 0, got {length}")
        device = self.values.device
        sample = torch.repeat_interleave(torch.arange(batch, device=device), self.lengths)
        position = torch.arange(self.values.shape[0], device=device) - self.offsets()[sample]
        keep = position < length
        padded = self.values.new_zeros(batch, length, dim)
        padded = padded.index_put((sample[keep], position[keep]), self.values[keep])
        mask = torch.arange(length, device=device) < self.lengths.unsqueeze(1)
        return padded, mask


@dataclass(frozen=True)
class SequenceEmbeddings:
    """Unpooled embeddings of a batch: `out["history"]` is that feature's JaggedEmbeddings."""

    features: Mapping[str, JaggedEmbeddings]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.features)

    def __getitem__(self, key: str) -> JaggedEmbeddings:
        if key not in self.features:
            raise EmbeddingInputError(
                f"no feature {key!r} in these embeddings; they have {list(self.features)}"
            )
        return self.features[key]

    def to_dict(self) -> dict[str, JaggedEmbeddings]:
        return dict(self.features)


class EmbeddingCollection(TableRecords, nn.Module):
    """Tables (EmbeddingConfig) whose features return one row per id: `forward(features)` is a
    SequenceEmbeddings. Per-id weights are refused (there is no sum for them to scale)."""

    sharded_by = "shard_embeddings"  # meta.SHARD_FIRST (materializing it itself is allowed)

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for table in tables:
            if not isinstance(table, EmbeddingConfig):
                raise EmbeddingInputError(
                    f"EmbeddingCollection takes EmbeddingConfig tables (one row per id, no "
                    f"pooling), got {type(table).__name__} {getattr(table, 'name', table)!r}; "
                    "write EmbeddingConfig(name, num_embeddings, embedding_dim, ...) or use an "
                    "EmbeddingBagCollection for pooled features"
                )
        self.configs, self.seed = tuple(tables), seed
        self.tables = make_tables(self.configs, seed, device)
        self.raw_id_remap = managed_remapper(self.configs, device)
        self.feature_names = tuple(f for c in tables for f in c.feature_names)
        self.feature_check = FeatureCheck(self.configs)

    def forward(self, features: SparseFeatures) -> SequenceEmbeddings:
        features = hash_raw_ids(check_sequence_features(features, self.feature_check), self.configs)
        if self.raw_id_remap is not None:  # ManagedCollisions tables: raw ids to rows
            features = self.raw_id_remap(features)
        out = {}
        for config in self.configs:
            weight = table_of(self.tables, config.name).weight
            for name in config.feature_names:
                ids = features[name]
                rows = F.embedding(ids.values, weight, sparse=True)
                # half rows come out float32, as the sharded collection's (rounding.py)
                rows = rows.to(accumulation_dtype(weight.dtype))
                out[name] = JaggedEmbeddings(rows, ids.lengths)
        return SequenceEmbeddings(out)


def check_sequence_features(
    features: SparseFeatures, tables: Sequence[EmbeddingBagConfig] | FeatureCheck
) -> SparseFeatures:
    """check_features (keys in the tables' order, ids in range; `tables`: the configs or
    their FeatureCheck), no per-id weights and one bag per sample (no batch per feature)."""
    if isinstance(features, SparseFeatures) and features.inverse_indices is not None:
        counts = features.bag_counts()
        own = [k for k, n in zip(features.keys, counts, strict=True) if n != features.batch_size]
        raise EmbeddingInputError(
            f"features {own or list(features.keys)} hold their own number of bags "
            f"({dict(zip(features.keys, counts, strict=True))} for {features.batch_size} "
            f"samples), but sequence embeddings take one sequence per sample; pass "
            "features.expand() (each sample's sequence copied out)"
        )
    if isinstance(features, SparseFeatures) and features.weights is not None:
        raise EmbeddingInputError(
            f"features {list(features.keys)} carry per-id weights, but sequence embeddings "
            "return one row per id and pool nothing for a weight to scale; drop the weights, "
            "or multiply each returned row by its weight"
        )
    return check_features(features, tables)
