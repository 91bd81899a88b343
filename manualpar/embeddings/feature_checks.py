"""The checks a SparseFeatures passes when it is built (features.py): keys, ids and lengths of
one batch, its bags per feature (variable_batch.py) and its weights, each error naming the
feature and what to do; it returns each key's id count, which the batch keeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from manualpar.eager import eager_only
from manualpar.embeddings.variable_batch import bag_starts, check_variable_batch, ids_per_key
from manualpar.errors import EmbeddingInputError

__all__ = ["validate_features"]


class Batch(Protocol):
    """What the checks read of a SparseFeatures."""

    @property
    def keys(self) -> tuple[str, ...]: ...
    @property
    def values(self) -> torch.Tensor: ...
    @property
    def lengths(self) -> torch.Tensor: ...
    @property
    def weights(self) -> torch.Tensor | None: ...
    @property
    def bags_per_key(self) -> tuple[int, ...] | None: ...
    @property
    def inverse_indices(self) -> torch.Tensor | None: ...

    def bag_counts(self) -> Sequence[int]: ...


# Validation reads values back to the host (.item(), .tolist()); under torch.compile it runs
# eagerly, once per batch, instead of splitting the caller's graph at every read.
@eager_only("SparseFeatures validation reads values back to the host")
def validate_features(batch: Batch) -> list[int]:
    """Raise EmbeddingInputError naming what is wrong; return each key's number of ids."""
    keys, values, lengths, weights = batch.keys, batch.values, batch.lengths, batch.weights
    if len(set(keys)) != len(keys):
        raise EmbeddingInputError(f"feature keys must be unique, got {list(keys)}")
    for name, tensor in (("values", values), ("lengths", lengths)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
            got = (
                f"a tensor of shape {tuple(tensor.shape)}"
                if isinstance(tensor, torch.Tensor)
                else type(tensor).__name__
            )
            raise EmbeddingInputError(
                f"SparseFeatures.{name} must be a 1-D tensor, got {got}; use from_dict() to "
                "build a batch from Python lists"
            )
        if tensor.dtype not in (torch.int64, torch.int32):
            what, hint = (
                ("ids", " (hash float or string categories to ids first)")
                if name == "values"
                else ("bag lengths", "")
            )
            raise EmbeddingInputError(
                f"SparseFeatures.{name} (features {list(keys)}) must hold integer {what} (int64 "
                f"or int32), got {tensor.dtype}; convert with .long(){hint}"
            )
    variable = batch.inverse_indices is not None
    if variable != (batch.bags_per_key is not None):
        raise EmbeddingInputError(
            "a batch per feature needs both bags_per_key (each feature's bag count) and "
            "inverse_indices (the bag each sample reads), or neither"
        )
    if variable:
        assert batch.bags_per_key is not None and batch.inverse_indices is not None
        check_variable_batch(keys, lengths, batch.bags_per_key, batch.inverse_indices)
    elif keys and lengths.numel() % len(keys):
        raise EmbeddingInputError(
            f"lengths has {lengths.numel()} entries, not a multiple of the {len(keys)} keys "
            f"{list(keys)}: expected one length per (key, sample)"
        )
    if not keys and (lengths.numel() or values.numel()):
        raise EmbeddingInputError("a batch without keys cannot hold ids")
    starts = bag_starts(batch.bag_counts())
    if lengths.numel() and bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0])
        f = next(k for k in range(len(keys)) if starts[k + 1] > bad)
        which = "bag" if variable else "sample"
        raise EmbeddingInputError(
            f"feature {keys[f]!r}: negative bag length {int(lengths[bad])} for {which} "
            f"{bad - starts[f]}; a length counts the ids of one bag and must be >= 0"
        )
    sizes: list[int]
    if variable:
        sizes = ids_per_key(lengths, batch.bag_counts())
    else:
        sizes = lengths.view(len(keys), -1).sum(1).tolist() if keys else []
    total = sum(sizes)
    if total != values.numel():
        raise EmbeddingInputError(
            f"lengths add up to {total} ids (per feature {dict(zip(keys, sizes, strict=True))}) "
            f"but values holds {values.numel()}; lengths and ids must describe the same bags"
        )
    if weights is not None and (not weights.is_floating_point() or weights.shape != values.shape):
        raise EmbeddingInputError(
            f"weights must be a float tensor with one weight per id (shape "
            f"{tuple(values.shape)}), got {weights.dtype} of shape {tuple(weights.shape)}"
        )
    return sizes
