"""Criteo-shaped click data: a synthetic generator with a learnable signal, and the tables the
model reads it into (manualpar.data streams the real format into the same `CriteoBatch`).

It gives batches addressed by step, the Trainer's data contract: `train(step, strategy)` is
this rank's share of global batch `step`, the same on every run, so a resumed run sees exactly
the batches the uninterrupted one would have seen.

Synthetic samples are a pure function of (seed, sample index): each value is drawn from a hash of
(seed, index, field), so any range of samples can be produced by any rank, in any order. The
label is Bernoulli(sigmoid(logit)); the logit depends on three dense features, on hidden
per-id effects of five categorical features and on one cross effect between two features, so a
model that learns those ids' embeddings and the dense response reaches an AUC well above 0.5.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from manualpar import HashIds, ManagedCollisions, ManualParallelStrategy
from manualpar.data import CRITEO_FEATURES as FEATURES
from manualpar.data import NUM_DENSE, NUM_SPARSE, CriteoBatch, criteo_batch, log_counts
from manualpar.embeddings import EmbeddingBagConfig

# Rows per categorical feature, as published with DLRM/TorchRec for the two Criteo datasets.
CARDINALITIES = {
    "kaggle": (
        1460,
        583,
        10131227,
        2202608,
        305,
        24,
        12517,
        633,
        3,
        93145,
        5683,
        8351593,
        3194,
        27,
        14992,
        5461306,
        10,
        5652,
        2173,
        4,
        7046547,
        18,
        15,
        286181,
        105,
        142572,
    ),
    "terabyte": (
        45833188,
        36746,
        17245,
        7413,
        20243,
        3,
        7114,
        1441,
        62,
        29275261,
        1572176,
        345138,
        10,
        2209,
        11267,
        128,
        4,
        974,
        14,
        48937457,
        11316796,
        40094537,
        452104,
        12606,
        104,
        35,
    ),
}

# The hidden signal: dense feature -> weight on its standardized latent, categorical feature ->
# standard deviation of its per-id effect (tables of 27 to 93k rows), and one cross effect: the
# dot product of rank-4 per-id vectors of two features, what DLRM's dot interaction models.
DENSE_WEIGHTS = {0: 0.8, 1: -0.6, 2: 0.5}
ID_EFFECTS = {0: 0.8, 4: 0.7, 6: 0.8, 9: 0.6, 13: 0.5}
CROSS_FIELDS, CROSS_RANK, CROSS_SCALE = (2, 10), 4, 0.8
BIAS = -1.1  # about 30% positives, Criteo-like (26%)
VALIDATION_OFFSET = 2**40  # validation samples never overlap training samples


def table_rows(cardinalities: str = "kaggle", max_rows: int | None = 100_000) -> list[int]:
    """Rows of the 26 tables: the published cardinalities, capped at `max_rows` (None: uncapped)."""
    rows = CARDINALITIES[cardinalities]
    return [r if max_rows is None else min(r, max_rows) for r in rows]


def make_tables(
    rows: Sequence[int], dim: int, dtype: torch.dtype = torch.float32
) -> list[EmbeddingBagConfig]:
    """One table per categorical feature (the feature takes the table's name), rows stored in
    `dtype` (float32, float16 or bfloat16; lookups return float32 either way)."""
    return [
        EmbeddingBagConfig(name, num_embeddings=r, embedding_dim=dim, dtype=dtype)
        for name, r in zip(FEATURES, rows, strict=True)
    ]


RAW_ID_MODES = ("hash", "lru", "lfu")


def raw_id_tables(
    tables: Sequence[EmbeddingBagConfig], mode: str = "hash"
) -> list[EmbeddingBagConfig]:
    """The tables reading raw ids (hex values, MISSING_ID): hashed into rows (`mode` "hash") or
    given rows by managed collisions evicting the least recently ("lru") or least often ("lfu")
    seen id; salt = the table's position, so each feature's ids land independently."""
    if mode not in RAW_ID_MODES:
        raise ValueError(f"raw-id mode must be one of {RAW_ID_MODES}, got {mode!r}")
    return [
        dataclasses.replace(
            table,
            raw_ids=HashIds(salt=index)
            if mode == "hash"
            else ManagedCollisions(policy=mode, salt=index),
        )
        for index, table in enumerate(tables)
    ]


def hashed_tables(tables: Sequence[EmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    """`raw_id_tables(tables, "hash")`."""
    return raw_id_tables(tables, "hash")


def rank_slice(global_batch: int, strategy: ManualParallelStrategy) -> tuple[int, int]:
    """(offset, size) of this rank's contiguous share of a global batch."""
    world, rank = strategy.world_size, strategy.rank
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} is not a multiple of {world} ranks")
    size = global_batch // world
    return rank * size, size


# ---- synthetic ------------------------------------------------------------------------------
def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective, well-mixed 64-bit hash (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _hash(*parts: np.ndarray | int) -> np.ndarray:
    out = np.asarray(0, dtype=np.uint64)
    for part in parts:
        out = _mix(out ^ np.asarray(part).astype(np.uint64))
    return out


def _uniform(*parts: np.ndarray | int) -> np.ndarray:
    """Floats in (0, 1), one per broadcast element of `parts`."""
    return ((_hash(*parts) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _normal(*parts: np.ndarray | int) -> np.ndarray:
    return torch.special.ndtri(torch.from_numpy(_uniform(*parts))).numpy()


class SyntheticCriteo:
    """Criteo-like samples with a learnable signal; see the module docstring.

    Ids are heavy-tailed (log-uniform ranks, as click logs: a few ids are very frequent) and
    scattered over the table by a bijective multiplicative hash, so frequent ids land on every
    shard of a row-wise table.
    """

    # hash streams
    DENSE, IDS, EFFECT, LABEL, CROSS = 1, 2, 3, 4, 5
    SCATTER = 2_654_435_761  # prime: a bijection modulo any table size it does not divide

    def __init__(
        self, rows: Sequence[int], *, seed: int = 0, batch_size: int = 512, val_samples: int = 8192
    ) -> None:
        if len(rows) != NUM_SPARSE:
            raise ValueError(f"expected {NUM_SPARSE} table sizes, got {len(rows)}")
        self.rows = np.asarray(rows, dtype=np.int64)
        self.seed, self.batch_size, self.val_samples = seed, batch_size, val_samples

    def raw(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Labels (B,), counts (B, 13) and ids (B, 26) of samples [start, start + count)."""
        index = np.arange(start, start + count, dtype=np.uint64)[:, None]
        latent = _normal(self.seed, self.DENSE, index, np.arange(NUM_DENSE))
        counts = np.floor(np.expm1(np.maximum(1.5 + 1.2 * latent, 0.0))).astype(np.int64)
        u = _uniform(self.seed, self.IDS, index, np.arange(NUM_SPARSE))
        ranks = np.minimum(np.floor(self.rows.astype(np.float64) ** u) - 1, self.rows - 1)
        ids = (ranks.astype(np.int64) * self.SCATTER + 7919 * np.arange(NUM_SPARSE)) % self.rows
        logit = np.full(count, BIAS)
        for field, weight in DENSE_WEIGHTS.items():
            logit += weight * latent[:, field]
        for field, scale in ID_EFFECTS.items():
            logit += scale * _normal(self.seed, self.EFFECT, field, ids[:, field])
        left, right = (
            _normal(self.seed, self.CROSS, f, ids[:, f, None], np.arange(CROSS_RANK))
            for f in CROSS_FIELDS
        )
        logit += CROSS_SCALE * (left * right).sum(1) / np.sqrt(CROSS_RANK)
        p = 1 / (1 + np.exp(-logit))
        labels = (_uniform(self.seed, self.LABEL, index[:, 0]) < p).astype(np.int64)
        return labels, counts, ids

    def samples(self, start: int, count: int) -> CriteoBatch:
        labels, counts, ids = self.raw(start, count)
        return criteo_batch(labels, log_counts(counts), ids)

    def train(self, step: int, strategy: ManualParallelStrategy) -> CriteoBatch:
        """This rank's share of global batch `step` (the Trainer's `data`)."""
        offset, size = rank_slice(self.batch_size, strategy)
        return self.samples(step * self.batch_size + offset, size)

    def validation(self, index: int, strategy: ManualParallelStrategy) -> CriteoBatch:
        """This rank's share of the whole validation set (one batch; `index` is always 0)."""
        offset, size = rank_slice(self.val_samples, strategy)
        return self.samples(VALIDATION_OFFSET + index * self.val_samples + offset, size)
