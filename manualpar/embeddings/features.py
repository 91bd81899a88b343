"""SparseFeatures: a jagged batch of categorical ids, one bag of ids per (feature, sample).

Layout (the one TorchRec and FBGEMM use, so data converts without copies): `values` holds every
id, feature-major (all bags of the first key, then the second key, ...); `lengths[f * B + b]` is
the number of ids in bag b of feature f. Optional `weights` hold one float per id (weighted
pooling). The batch is validated when built, so a malformed batch fails here, naming the
feature, and not later inside a collective; the validation runs eagerly even when the batch is
built inside a torch.compile'd function.

TorchRec's KeyedJaggedTensor has the same layout: `from_kjt` reads one (or any object with its
methods) and `to_kjt` builds one, sharing the tensors; TorchRec is imported only by `to_kjt`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from manualpar.eager import eager_only
from manualpar.errors import EmbeddingInputError, MissingDependencyError

__all__ = ["JaggedFeature", "SparseFeatures"]


@dataclass(frozen=True)
class JaggedFeature:
    """The bags of one feature: ids, lengths (one per sample) and optional per-id weights."""

    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    def offsets(self) -> torch.Tensor:
        return _offsets(self.lengths)

    def to_lists(self) -> list[list[int]]:
        return [bag.tolist() for bag in torch.split(self.values, self.lengths.tolist())]


@dataclass(frozen=True)
class SparseFeatures:
    """A batch of ids: `keys`, then every bag's ids feature-major in `values`, one length per
    (key, sample) in `lengths`, optional per-id `weights`; validated when built."""

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None
    _sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        sizes = _validate(self)
        object.__setattr__(self, "values", self.values.to(torch.int64))
        object.__setattr__(self, "lengths", self.lengths.to(torch.int64))
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
    ) -> SparseFeatures:
        """A batch made of parts of a validated one (int64 tensors, sizes known): skips the
        validation, whose host reads would break a compiled caller's graph."""
        batch = object.__new__(cls)
        for name, value in (
            ("keys", keys),
            ("values", values),
            ("lengths", lengths),
            ("weights", weights),
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
    ) -> SparseFeatures:
        """From Python lists: {"user": [[1, 2], [], [7]], "item": [[3], [4], [5, 6]]}."""
        keys = tuple(bags)
        sizes = {key: len(b) for key, b in bags.items()}
        if len(set(sizes.values())) > 1:
            raise EmbeddingInputError(
                f"every feature needs one bag per sample, got bag counts {sizes}; "
                "use an empty list for a sample without ids"
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
        if offsets.dim() != 1 or offsets.numel() == 0 or int(offsets[0]) != 0:
            raise EmbeddingInputError("offsets must be a 1-D tensor starting at 0")
        return cls(tuple(keys), values, torch.diff(offsets), weights)

    @classmethod
    def from_kjt(cls, kjt: Any) -> SparseFeatures:
        """From a TorchRec KeyedJaggedTensor, or any object with its methods (duck typing, so
        TorchRec need not be installed): keys(), values(), lengths() or offsets(), and
        weights_or_none(). The tensors are shared when they are already int64."""
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
        variable = getattr(kjt, "variable_stride_per_key", None)
        if callable(variable) and variable():
            raise EmbeddingInputError(
                "SparseFeatures.from_kjt(): this KeyedJaggedTensor has a batch size per feature "
                "(variable stride); SparseFeatures needs one bag per sample for every feature, "
                "so give each feature the same number of bags (empty ones where it has no ids)"
            )
        keys, values, weights = tuple(kjt.keys()), kjt.values(), kjt.weights_or_none()
        lengths = kjt.lengths() if has_lengths else None
        if lengths is None:
            if not has_offsets:
                raise EmbeddingInputError(
                    f"SparseFeatures.from_kjt(): a {type(kjt).__name__}'s lengths() returned "
                    "None and it has no offsets(); give it lengths or offsets"
                )
            return cls.from_offsets(keys, values, kjt.offsets(), weights)
        return cls(keys, values, lengths, weights)

    @classmethod
    def from_features(cls, features: Mapping[str, JaggedFeature]) -> SparseFeatures:
        """Concatenate per-feature bags (all with the same number of samples)."""
        keys = tuple(features)
        parts = list(features.values())
        weighted = [p.weights is not None for p in parts]
        if any(weighted) and not all(weighted):
            raise EmbeddingInputError("either every feature has weights or none does")
        return cls(
            keys,
            torch.cat([p.values for p in parts]) if parts else torch.empty(0),
            torch.cat([p.lengths for p in parts]) if parts else torch.empty(0),
            torch.cat([p.weights for p in parts if p.weights is not None])
            if all(weighted) and parts
            else None,
        )

    # views ------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys) if self.keys else 0

    def offsets(self) -> torch.Tensor:
        return _offsets(self.lengths)

    def feature_sizes(self) -> list[int]:
        """Number of ids of each key."""
        return list(self._sizes)

    def __getitem__(self, key: str) -> JaggedFeature:
        if key not in self.keys:
            raise EmbeddingInputError(f"no feature {key!r} in this batch; it has {list(self.keys)}")
        index = self.keys.index(key)
        batch = self.batch_size
        start = sum(self._sizes[:index])
        end = start + self._sizes[index]
        lengths = self.lengths[index * batch : (index + 1) * batch]
        weights = None if self.weights is None else self.weights[start:end]
        return JaggedFeature(self.values[start:end], lengths, weights)

    def to_dict(self) -> dict[str, JaggedFeature]:
        return {key: self[key] for key in self.keys}

    def to(self, device: torch.device | str) -> SparseFeatures:
        weights = None if self.weights is None else self.weights.to(device)
        return SparseFeatures(self.keys, self.values.to(device), self.lengths.to(device), weights)

    def select(self, keys: Sequence[str]) -> SparseFeatures:
        """The same batch with only `keys`, in that order (a key named twice is kept once)."""
        keys = tuple(dict.fromkeys(keys))
        parts = [self[key] for key in keys]
        if not parts:
            return SparseFeatures._checked((), self.values[:0], self.lengths[:0], None, ())
        weighted = [p.weights for p in parts if p.weights is not None]
        weights = torch.cat(weighted) if self.weights is not None else None
        return SparseFeatures._checked(
            keys,
            torch.cat([p.values for p in parts]),
            torch.cat([p.lengths for p in parts]),
            weights,
            tuple(self._sizes[self.keys.index(key)] for key in keys),
        )

    def to_kjt(self) -> Any:
        """This batch as a TorchRec `KeyedJaggedTensor` sharing its tensors (TorchRec is imported
        here, and only here; ImportError says how to get it when it is missing)."""
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
        return jagged.KeyedJaggedTensor(
            keys=list(self.keys),
            values=self.values,
            lengths=self.lengths,
            weights=self.weights,
            stride=self.batch_size,
        )


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


# Validation reads values back to the host (.item(), .tolist()); under torch.compile it runs
# eagerly, once per batch, instead of splitting the caller's graph at every read.
@eager_only("SparseFeatures validation reads values back to the host")
def _validate(batch: SparseFeatures) -> list[int]:
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
    if keys and lengths.numel() % len(keys):
        raise EmbeddingInputError(
            f"lengths has {lengths.numel()} entries, not a multiple of the {len(keys)} keys "
            f"{list(keys)}: expected one length per (key, sample)"
        )
    if not keys and (lengths.numel() or values.numel()):
        raise EmbeddingInputError("a batch without keys cannot hold ids")
    if lengths.numel() and bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0])
        raise EmbeddingInputError(
            f"feature {keys[bad // batch.batch_size]!r}: negative bag length "
            f"{int(lengths[bad])} for sample {bad % batch.batch_size}; a length counts the ids "
            "of one bag and must be >= 0"
        )
    sizes: list[int] = lengths.view(len(keys), -1).sum(1).tolist() if keys else []
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
