"""EmbeddingBagConfig: one table's shape, the features that look it up, pooling and init."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from manualpar.embeddings.id_spaces import HashIds, ManagedCollisions, RawIds
from manualpar.errors import EmbeddingInputError

__all__ = [
    "BUILDER",
    "ROW_WISE_STATE",
    "TABLE_DTYPES",
    "EmbeddingBagConfig",
    "block_bytes",
    "check_tables",
]

# The builder's name, as errors and ownership claims spell it.
BUILDER = "shard_embeddings"
POOLINGS = ("sum", "mean")
# Rows are stored in one of these; lookups accumulate and updates compute in float32.
TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STATE_BYTES = 4  # optimizer state is float32 whatever the rows' dtype
# An update rule's state: name -> per-row (one float per row) or per-element. Row-wise Adagrad's
# single per-row float is what plans count when no rule is named (it is the planner's default).
ROW_WISE_STATE: Mapping[str, bool] = {"sum": True}
MAX_SIZE = 2**63 - 1  # rows and columns: a tensor's sizes (and the ids) are int64


def _plain_name(name: object) -> bool:
    """A non-empty string without unprintable characters: names become file names, checkpoint
    keys and lines of text, where a NUL or a newline would cut or corrupt them."""
    return isinstance(name, str) and bool(name) and name.isprintable()


def block_bytes(
    rows: int,
    cols: int,
    state: Mapping[str, bool] = ROW_WISE_STATE,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes of a block of `rows` x `cols` weights in `dtype` plus its float32 optimizer `state`
    (one float per row for a per-row entry, one per element otherwise). The one place table
    memory is counted."""
    weight = cols * dtype.itemsize
    per_row_state = sum(1 if per_row else cols for per_row in state.values()) * STATE_BYTES
    return rows * (weight + per_row_state)


@dataclass(frozen=True)
class EmbeddingBagConfig:
    """A table of `num_embeddings` rows of `embedding_dim` floats.

    Each feature in `feature_names` (default: the table's own name) is looked up in this table and
    pooled into one vector per sample (`pooling` "sum" or "mean"; weighted ids scale their rows).
    Rows start uniform in [-init_bound, init_bound] (default 1/sqrt(num_embeddings), as TorchRec).

    `dtype` is how rows are stored (float32, float16 or bfloat16); lookups sum in float32 and
    the fused update computes in float32 and rounds back (docs/embeddings-storage.md, "Precision").
    `raw_ids`: None (ids are rows in [0, num_embeddings)), `HashIds(salt)` or
    `ManagedCollisions(...)` for raw int64 ids from an unbounded space (id_spaces.py).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = field(default=())
    pooling: str = "sum"
    init_bound: float | None = None
    dtype: torch.dtype = torch.float32
    raw_ids: RawIds | None = None

    def __post_init__(self) -> None:
        if isinstance(self.feature_names, str):  # tuple("abc") would be three features
            raise EmbeddingInputError(
                f"table {self.name!r}: feature_names must be a sequence of names, got the string "
                f"{self.feature_names!r}; write feature_names=({self.feature_names!r},)"
            )
        object.__setattr__(self, "feature_names", tuple(self.feature_names) or (self.name,))
        if not _plain_name(self.name) or "/" in self.name or "." in self.name:
            raise EmbeddingInputError(
                f"table name {self.name!r} must be a non-empty string without '/', '.' or "
                "unprintable characters"
            )
        for feature in self.feature_names:
            if not _plain_name(feature):
                raise EmbeddingInputError(
                    f"table {self.name!r}: feature name {feature!r} must be a non-empty string "
                    "without unprintable characters"
                )
        for what, value in (
            ("num_embeddings", self.num_embeddings),
            ("embedding_dim", self.embedding_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EmbeddingInputError(
                    f"table {self.name!r}: {what} must be a positive int, got {value!r}"
                )
            if value > MAX_SIZE:
                raise EmbeddingInputError(
                    f"table {self.name!r}: {what} must be at most 2**63 - 1 (a tensor's sizes "
                    f"are int64), got {value}"
                )
        if self.pooling not in POOLINGS:
            raise EmbeddingInputError(
                f"table {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}"
            )
        if self.dtype not in TABLE_DTYPES:
            raise EmbeddingInputError(
                f"table {self.name!r}: dtype {self.dtype} is not supported; use one of "
                f"{', '.join(str(d) for d in TABLE_DTYPES)}"
            )
        if self.raw_ids is not None and not isinstance(self.raw_ids, HashIds | ManagedCollisions):
            raise EmbeddingInputError(
                f"table {self.name!r}: raw_ids must be None, HashIds(...) or "
                f"ManagedCollisions(...), got {self.raw_ids!r}"
            )

    @property
    def bound(self) -> float:
        return (
            self.init_bound if self.init_bound is not None else 1 / math.sqrt(self.num_embeddings)
        )

    @property
    def num_bytes(self) -> int:
        """Weight bytes in the table's dtype (no optimizer state)."""
        return block_bytes(self.num_embeddings, self.embedding_dim, state={}, dtype=self.dtype)


def check_tables(tables: Sequence[EmbeddingBagConfig]) -> None:
    """Table names unique, each feature looked up by exactly one table."""
    names = [t.name for t in tables]
    if not tables:
        raise EmbeddingInputError("an embedding collection needs at least one table")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise EmbeddingInputError(f"table names must be unique; repeated: {duplicates}")
    owners: dict[str, str] = {}
    for table in tables:
        for feature in table.feature_names:
            if feature in owners:
                raise EmbeddingInputError(
                    f"feature {feature!r} is listed by tables {owners[feature]!r} and "
                    f"{table.name!r}; a feature must look up exactly one table"
                )
            owners[feature] = table.name
