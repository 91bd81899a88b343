"""Raw int64 ids to rows: the stable salted hash behind `HashIds` (and the buckets of
`ManagedCollisions`).

The hash, documented so that anyone can reproduce it (docs/embeddings.md, "Raw ids"), with
mix(z) splitmix64's finalizer on unsigned 64-bit integers (table_init.mix64):

    key(salt)    = mix((salt + 0x9E3779B97F4A7C15) mod 2**64)
    H(id, salt)  = mix((id mod 2**64) XOR key(salt))          # id as its two's complement bits
    row          = H(id, salt) mod num_embeddings               # unsigned

It uses only int64 torch ops (multiplication wraps like uint64 on every device), so it gives the
same rows on every run, machine, device and world size, vectorized over a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.id_spaces import HashIds
from manualpar.embeddings.table_init import mix64, mix64_int

__all__ = ["hash_ids", "hash_raw_ids", "hashed_rows", "salt_key", "unsigned_mod"]

_GOLDEN = 0x9E3779B97F4A7C15
_MAX_MODULUS = 1 << 62  # unsigned_mod's intermediate 2 * (q mod n) + 1 must stay below 2**63


def salt_key(salt: int) -> int:
    """key(salt) as a signed int64 (the bit pattern the tensors XOR with)."""
    key = mix64_int(salt + _GOLDEN)
    return key - (1 << 64) if key >= 1 << 63 else key


def hash_ids(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """H(id, salt) for int64 `ids` (any values, negative too), as int64 bit patterns."""
    return mix64(ids.to(torch.int64) ^ salt_key(salt))


def unsigned_mod(bits: torch.Tensor, modulus: int) -> torch.Tensor:
    """(bits read as uint64) mod `modulus`, in int64 ops: u = 2q + b with q = u >> 1."""
    if not 1 <= modulus <= _MAX_MODULUS:
        raise ValueError(f"modulus must be in [1, 2**62], got {modulus}")
    half = (bits >> 1) & ((1 << 63) - 1)  # logical shift: q, non-negative
    return (half % modulus * 2 + (bits & 1)) % modulus


def hashed_rows(ids: torch.Tensor, salt: int, rows: int) -> torch.Tensor:
    """The rows of raw `ids` in a table of `rows` rows: H(id, salt) mod rows."""
    return unsigned_mod(hash_ids(ids, salt), rows)


def hash_raw_ids(features: SparseFeatures, tables: Sequence[EmbeddingBagConfig]) -> SparseFeatures:
    """The batch with the ids of every `HashIds` table's features replaced by their rows.
    `features` holds the tables' features in their order (as check_features returns it)."""
    if not any(isinstance(t.raw_ids, HashIds) for t in tables):
        return features
    parts = list(features.values.split(features.feature_sizes()))
    index = 0
    for table in tables:
        for _ in table.feature_names:
            if isinstance(table.raw_ids, HashIds):
                parts[index] = hashed_rows(parts[index], table.raw_ids.salt, table.num_embeddings)
            index += 1
    values = torch.cat(parts) if parts else features.values
    return SparseFeatures(features.keys, values, features.lengths, features.weights)
