"""Raw int64 ids to rows: the stable salted hash behind `HashIds` (and the buckets of
`ManagedCollisions`).

The hash, documented so that anyone can reproduce it (docs/embeddings-raw-ids.md, "Hashing"), with
mix(z) splitmix64's finalizer on unsigned 64-bit integers (table_init.mix64):

    key(salt)    = mix((salt + 0x9E3779B97F4A7C15) mod 2**64)
    H(id, salt)  = mix((id mod 2**64) XOR key(salt))          # id as its two's complement bits
    row          = H(id, salt) mod num_embeddings               # unsigned

It uses only int64 torch ops (multiplication wraps like uint64 on every device), so it gives the
same rows on every run, machine, device and world size, vectorized over a batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.id_spaces import HashIds
from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.kernels.splitmix import mix64, mix64_int
from manualpar.errors import ConfigError

__all__ = [
    "hash_ids",
    "hash_raw_ids",
    "hashed_rows",
    "salt_key",
    "table_ids",
    "unsigned_mod",
    "with_table_ids",
]

_GOLDEN = 0x9E3779B97F4A7C15
_MAX_MODULUS = 1 << 62  # unsigned_mod's intermediate 2 * (q mod n) + 1 must stay below 2**63


def salt_key(salt: int) -> int:
    """key(salt) as a signed int64 (the bit pattern the tensors XOR with)."""
    key = mix64_int(salt + _GOLDEN)
    return key - (1 << 64) if key >= 1 << 63 else key


def hash_ids(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """H(id, salt) for int64 `ids` (any values, negative too), as int64 bit patterns."""
    return mix64(ids.to(torch.int64) ^ salt_key(salt))


def unsigned_mod(bits: torch.Tensor, modulus: int | torch.Tensor) -> torch.Tensor:
    """(bits read as uint64) mod `modulus` (an int, or one per element), in int64 ops:
    u = 2q + b with q = u >> 1."""
    if isinstance(modulus, int) and not 1 <= modulus <= _MAX_MODULUS:
        raise ConfigError(f"modulus must be in [1, 2**62], got {modulus}")
    half = (bits >> 1) & ((1 << 63) - 1)  # logical shift: q, non-negative
    return (half % modulus * 2 + (bits & 1)) % modulus


def hashed_rows(ids: torch.Tensor, salt: int, rows: int) -> torch.Tensor:
    """The rows of raw `ids` in a table of `rows` rows: H(id, salt) mod rows."""
    return unsigned_mod(hash_ids(ids, salt), rows)


def hash_raw_ids(features: SparseFeatures, tables: Sequence[EmbeddingBagConfig]) -> SparseFeatures:
    """The batch with the ids of every `HashIds` table's features replaced by their rows.
    `features` holds the tables' features in their order (as check_features returns it)."""
    hashed = [t for t in tables if isinstance(t.raw_ids, HashIds)]
    if not hashed:
        return features
    if native_kernels_take(features.values):
        return _hash_natively(features, tables)
    ids = table_ids(features, tables, hashed)
    rows = {}
    for table in hashed:
        assert isinstance(table.raw_ids, HashIds)
        rows[table.name] = hashed_rows(ids[table.name], table.raw_ids.salt, table.num_embeddings)
    return with_table_ids(features, tables, rows)


def _hash_natively(
    features: SparseFeatures, tables: Sequence[EmbeddingBagConfig]
) -> SparseFeatures:
    """`hash_raw_ids` in one C++ pass over the batch (kernels/csrc/raw_ids.cpp): no split,
    concatenation or dozen ops per table."""
    keys, rows = [], []
    for table in tables:
        salt, size = (
            (table.raw_ids.salt, table.num_embeddings)
            if isinstance(table.raw_ids, HashIds)
            else (0, 0)  # rows 0: the feature's ids are kept
        )
        keys += [salt_key(salt)] * len(table.feature_names)
        rows += [size] * len(table.feature_names)
    sizes = torch.tensor(features.feature_sizes())
    bounds = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])
    values = loaded_kernels().hash_feature_ids(
        features.values.to(torch.int64).contiguous(), bounds, torch.tensor(keys), torch.tensor(rows)
    )
    return features.with_values(values)


def table_ids(
    features: SparseFeatures,
    tables: Sequence[EmbeddingBagConfig],
    chosen: Sequence[EmbeddingBagConfig] | None = None,
) -> dict[str, torch.Tensor]:
    """The ids of each `chosen` table (default: all), its features' ids one after the other.
    `features` holds the features of `tables` in their order."""
    names = {t.name for t in (tables if chosen is None else chosen)}
    parts = features.values.split(features.feature_sizes())
    out, index = {}, 0
    for table in tables:
        count = len(table.feature_names)
        if table.name in names:
            out[table.name] = torch.cat(parts[index : index + count])
        index += count
    return out


def with_table_ids(
    features: SparseFeatures,
    tables: Sequence[EmbeddingBagConfig],
    ids: Mapping[str, torch.Tensor],
) -> SparseFeatures:
    """`features` with the ids of the tables in `ids` replaced (as `table_ids` lays them out)."""
    if not ids:
        return features
    sizes = features.feature_sizes()
    parts = list(features.values.split(sizes))
    index = 0
    for table in tables:
        count = len(table.feature_names)
        if table.name in ids:
            parts[index : index + count] = ids[table.name].split(sizes[index : index + count])
        index += count
    values = torch.cat(parts) if parts else features.values
    return features.with_values(values)
