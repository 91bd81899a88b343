"""SparseFeatures <-> TorchRec's KeyedJaggedTensor (the same layout, so no copy): read one by
duck typing (its methods, TorchRec need not be installed), its variable-stride form too
(stride_per_key_per_rank, inverse_indices: a batch per feature), and build one (TorchRec is
imported here, and only when building)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from manualpar.embeddings.variable_batch import inverse_rows
from manualpar.errors import EmbeddingInputError, MissingDependencyError

__all__ = ["KjtParts", "build_kjt", "lengths_of_offsets", "read_kjt"]

# keys, values, lengths, weights, bags per key and inverse indices (None, None: one bag per
# sample): SparseFeatures' fields
KjtParts = tuple[
    tuple[str, ...],
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
    tuple[int, ...] | None,
    torch.Tensor | None,
]


def read_kjt(kjt: Any) -> KjtParts:
    """A KeyedJaggedTensor's (or a look-alike's) parts; EmbeddingInputError names what it
    lacks."""
    has_lengths = callable(getattr(kjt, "lengths", None))
    has_offsets = callable(getattr(kjt, "offsets", None))
    missing = [
        f"{name}()"
        for name in ("keys", "values", "weights_or_none")
        if not callable(getattr(kjt, name, None))
    ]
    if not has_lengths and not has_offsets:
        missing.append("lengths() or offsets()")
    if missing:
        raise EmbeddingInputError(
            f"SparseFeatures.from_kjt(): a {type(kjt).__name__} has no {', '.join(missing)}; "
            "it takes a KeyedJaggedTensor or an object with keys(), values(), lengths() (or "
            "offsets()) and weights_or_none()"
        )
    keys, values, weights = tuple(kjt.keys()), kjt.values(), kjt.weights_or_none()
    lengths = kjt.lengths() if has_lengths else None
    if lengths is None:
        if not has_offsets:
            raise EmbeddingInputError(
                f"SparseFeatures.from_kjt(): a {type(kjt).__name__}'s lengths() returned "
                "None and it has no offsets(); give it lengths or offsets"
            )
        lengths = lengths_of_offsets(kjt.offsets())
    variable = getattr(kjt, "variable_stride_per_key", None)
    if callable(variable) and variable():
        bags, inverse = _variable_stride(kjt, keys)
        return keys, values, lengths, weights, bags, inverse
    return keys, values, lengths, weights, None, None


def build_kjt(parts: KjtParts, stride: int) -> Any:
    """A TorchRec KeyedJaggedTensor of `parts` (SparseFeatures' fields), sharing the tensors;
    `stride`: the batch size."""
    keys, values, lengths, weights, bags, inverse = parts
    try:
        jagged = importlib.import_module("torchrec.sparse.jagged_tensor")
    except ImportError as error:
        absent = (
            isinstance(error, ModuleNotFoundError)
            and (error.name or "").split(".")[0] == "torchrec"
        )
        raise MissingDependencyError(
            "SparseFeatures.to_kjt() needs TorchRec, which is not installed (pip install "
            "torchrec; manualpar itself does not need it)"
            if absent
            else f"SparseFeatures.to_kjt() needs TorchRec, which is installed but failed to "
            f"import: {error}"
        ) from error
    variable: dict[str, Any] = {}
    if bags is not None and inverse is not None:  # TorchRec's variable stride per key
        variable = {
            "stride_per_key_per_rank": [[n] for n in bags],
            "inverse_indices": (list(keys), inverse),
        }
    return jagged.KeyedJaggedTensor(
        keys=list(keys),
        values=values,
        lengths=lengths,
        weights=weights,
        stride=stride,
        **variable,
    )


def lengths_of_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """Bag lengths from offsets (one more entry, starting at 0)."""
    if offsets.dim() != 1 or offsets.numel() == 0 or int(offsets[0]) != 0:
        raise EmbeddingInputError("offsets must be a 1-D tensor starting at 0")
    return torch.diff(offsets)


def _variable_stride(kjt: Any, keys: tuple[str, ...]) -> tuple[tuple[int, ...], torch.Tensor]:
    """A variable-stride KeyedJaggedTensor's bags per key and (keys, batch) inverse indices."""
    missing = [
        f"{name}()"
        for name in ("stride_per_key_per_rank", "inverse_indices_or_none")
        if not callable(getattr(kjt, name, None))
    ]
    if missing:
        raise EmbeddingInputError(
            f"SparseFeatures.from_kjt(): a {type(kjt).__name__} with a variable stride per key "
            f"has no {', '.join(missing)}; they give each feature's bags and the bag each "
            "sample reads"
        )
    strides = kjt.stride_per_key_per_rank()
    inverse = kjt.inverse_indices_or_none()
    if inverse is None:
        raise EmbeddingInputError(
            "SparseFeatures.from_kjt(): this KeyedJaggedTensor has a batch size per feature "
            "(variable stride) but no inverse_indices to expand each feature's bags back to the "
            "batch; build it with inverse_indices=(keys, a (keys, batch) tensor of bag indices)"
        )
    if len(strides) != len(keys):
        raise EmbeddingInputError(
            f"SparseFeatures.from_kjt(): stride_per_key_per_rank has {len(strides)} rows for "
            f"the {len(keys)} keys {list(keys)}: one row (bags per rank) per key"
        )
    bags = {key: sum(row) for key, row in zip(keys, strides, strict=True)}
    names, indices = list(inverse[0]), inverse[1]
    if indices.dim() != 2 or indices.shape[0] != len(names):
        raise EmbeddingInputError(
            f"SparseFeatures.from_kjt(): inverse_indices names {names} but its tensor has "
            f"shape {tuple(indices.shape)}: one row of bag indices per key"
        )
    given = {name: indices[i].tolist() for i, name in enumerate(names) if name in bags}
    return tuple(bags.values()), inverse_rows(keys, bags, given).to(indices.device)
