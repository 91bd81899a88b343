"""What Criteo-format lines become: parsed columns (numpy) and the batch a model takes (torch).

A batch holds dense (B, 13) float32 log(1 + max(count, 0)) with missing counts as 0 (DLRM's
transform), the 26 categorical values as raw int64 ids (the hex value; a missing value is
MISSING_ID), one id per sample and feature, and the float labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from manualpar.embeddings import SparseFeatures

__all__ = [
    "CRITEO_FEATURES",
    "MISSING_ID",
    "NUM_DENSE",
    "NUM_SPARSE",
    "Columns",
    "CriteoBatch",
    "criteo_batch",
    "log_counts",
]

NUM_DENSE = 13  # integer fields of a Criteo line, I1..I13
NUM_SPARSE = 26  # categorical (hex) fields of a Criteo line, C1..C26
# the sparse features' names, C1 .. C26 in the file: the tables' names in the example models
CRITEO_FEATURES = tuple(f"cat_{i}" for i in range(NUM_SPARSE))
FIELDS = 1 + NUM_DENSE + NUM_SPARSE
FIELD_NAMES = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))
# one past the largest 8-digit hex value: never a real value's id
MISSING_ID = 1 << 32


@dataclass(frozen=True)
class CriteoBatch:
    """A batch of samples: dense (B, 13) log(1 + count), one id per categorical feature, labels."""

    dense: torch.Tensor
    sparse: SparseFeatures
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.numel()


def log_counts(counts: np.ndarray) -> np.ndarray:
    """Dense features as DLRM feeds them: log(1 + count), missing or negative counts as 0."""
    return np.log1p(np.maximum(counts, 0)).astype(np.float32)


def criteo_batch(labels: np.ndarray, dense: np.ndarray, ids: np.ndarray) -> CriteoBatch:
    """A batch from columns: labels (B,), dense (B, 13) log counts, ids (B, 26)."""
    dense_tensor = torch.from_numpy(np.asarray(dense, dtype=np.float32))
    values = torch.from_numpy(np.ascontiguousarray(ids.T, dtype=np.int64)).flatten()
    lengths = torch.ones(values.numel(), dtype=torch.int64)  # Criteo: single-valued features
    sparse = SparseFeatures(CRITEO_FEATURES, values, lengths)
    return CriteoBatch(dense_tensor, sparse, torch.from_numpy(labels.astype(np.float32)))


@dataclass(frozen=True)
class Columns:
    """Parsed lines: labels (n,) int64 0/1, dense (n, 13) float32 log counts, ids (n, 26) int64."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, start: int, stop: int) -> Columns:
        """Lines [start, stop)."""
        return Columns(self.labels[start:stop], self.dense[start:stop], self.ids[start:stop])

    def batch(self) -> CriteoBatch:
        """The lines as one batch (torch tensors)."""
        return criteo_batch(self.labels, self.dense, self.ids)

    @staticmethod
    def concat(parts: Sequence[Columns]) -> Columns:
        """The parts' lines in order (no copy for a single part)."""
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            dense = np.zeros((0, NUM_DENSE), np.float32)
            return Columns(empty, dense, empty.reshape(0, NUM_SPARSE))
        if len(parts) == 1:
            return parts[0]
        return Columns(
            np.concatenate([p.labels for p in parts]),
            np.concatenate([p.dense for p in parts]),
            np.concatenate([p.ids for p in parts]),
        )
