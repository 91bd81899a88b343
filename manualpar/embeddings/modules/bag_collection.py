"""EmbeddingBagCollection: tables looked up by sparse features, pooled per sample.

Unsharded, it is a plain module (gradients are torch sparse gradients, so torch's SGD, Adagrad
and SparseAdam train it): the single-process reference. `shard_embeddings` turns it into a
sharded module with a fused optimizer; built under `empty_init()` it allocates nothing until
then, and each rank then allocates only its shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from manualpar.eager import eager_only
from manualpar.embeddings.config import EmbeddingBagConfig, check_tables
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.ids.hashing import hash_raw_ids
from manualpar.embeddings.ids.managed_collisions import managed_per_sample, managed_remapper
from manualpar.embeddings.kernels.bags import bag_offsets
from manualpar.embeddings.kernels.half_lookup import pooled_sum_half
from manualpar.embeddings.kernels.rounding import HALF_DTYPES, accumulation_dtype
from manualpar.embeddings.kernels.row_memory import empty_rows
from manualpar.embeddings.modules.table_init import init_rows
from manualpar.embeddings.modules.table_record import TableRecords
from manualpar.embeddings.variable_batch import bag_starts
from manualpar.errors import EmbeddingInputError

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingTable",
    "FeatureCheck",
    "PooledEmbeddings",
    "check_features",
    "table_of",
    "table_weight",
]


@dataclass(frozen=True)
class PooledEmbeddings:
    """(batch, sum of dims) pooled embeddings; `out["user"]` is one feature's (batch, dim)."""

    values: torch.Tensor
    keys: tuple[str, ...]
    dims: tuple[int, ...]

    def slices(self) -> dict[str, slice]:
        out, start = {}, 0
        for key, dim in zip(self.keys, self.dims, strict=True):
            out[key] = slice(start, start + dim)
            start += dim
        return out

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.values[:, self.slices()[key]]

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {key: self.values[:, s] for key, s in self.slices().items()}


class EmbeddingTable(nn.Module):
    """One table's weight (or, once sharded, this rank's block of it)."""

    sharded_by = "shard_embeddings"  # meta.SHARD_FIRST: not materialized whole by accident

    def __init__(
        self,
        config: EmbeddingBagConfig,
        seed: int,
        rows: int | None = None,
        cols: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config, self.seed = config, seed
        self.weight = nn.Parameter(
            empty_rows(
                config.num_embeddings if rows is None else rows,
                config.embedding_dim if cols is None else cols,
                device=device,
                dtype=config.dtype,
            )
        )

    def reset_parameters(self) -> None:
        """Hashed per element: the same values whatever the sharding (see table_init)."""
        if self.weight.is_meta:
            return
        init_rows(
            self.config,
            self.seed,
            (0, self.config.num_embeddings),
            (0, self.config.embedding_dim),
            out=self.weight.detach(),
        )


def make_tables(
    configs: Sequence[EmbeddingBagConfig], seed: int, device: torch.device | str | None
) -> nn.ModuleDict:
    """A collection's checked, initialized tables by name (meta under empty_init)."""
    check_tables(configs)
    tables = {c.name: EmbeddingTable(c, seed, device=device) for c in configs}
    for table in tables.values():
        table.reset_parameters()
    return nn.ModuleDict(tables)


def table_of(tables: nn.ModuleDict, name: str) -> EmbeddingTable:
    """One table of a collection's ModuleDict, typed (ModuleDict lookups are plain Modules)."""
    table = tables[name]
    assert isinstance(table, EmbeddingTable), f"{name!r} is a {type(table).__name__}"
    return table


def table_weight(tables: nn.ModuleDict, name: str) -> torch.Tensor:
    """`table_of(tables, name).weight`, read straight from the module's registered parameters
    (a step reads it many times: a third of the attribute lookups' time); through the module
    where the weight is not a registered parameter there."""
    module = tables._modules.get(name)
    weight = None if module is None else module._parameters.get("weight")
    return table_of(tables, name).weight if weight is None else weight


class EmbeddingBagCollection(TableRecords, nn.Module):
    """Tables looked up by a SparseFeatures batch, one pooled row per (feature, sample): the
    unsharded reference, or the input of `shard_embeddings` (build it under `empty_init()`).

    Each table's rows start uniform in [-init_bound, init_bound] (EmbeddingBagConfig), hashed
    from (`seed`, table, row, column), so every plan gives the same initial values."""

    sharded_by = "shard_embeddings"  # meta.SHARD_FIRST (materializing it itself is allowed)

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.configs, self.seed = tuple(tables), seed
        self.tables = make_tables(self.configs, seed, device)
        self.raw_id_remap = managed_remapper(self.configs, device)
        self.feature_names = tuple(f for c in tables for f in c.feature_names)
        self.feature_check = FeatureCheck(self.configs)

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        features = hash_raw_ids(check_features(features, self.feature_check), self.configs)
        features = features.without_unread_bags()  # rows no sample reads stay untouched
        if self.raw_id_remap is not None:  # ManagedCollisions tables: raw ids to rows
            features = self.raw_id_remap(managed_per_sample(features, self.configs))
        outputs = []
        for config in self.configs:
            weight = table_of(self.tables, config.name).weight
            for name in config.feature_names:
                bags = features[name]
                if bags.lengths.numel() == 0:
                    dtype = accumulation_dtype(weight.dtype)
                    outputs.append(weight.new_zeros(0, config.embedding_dim, dtype=dtype))
                    continue
                if weight.dtype in HALF_DTYPES:  # summed in float32 (half_lookup.py)
                    pooled = pooled_sum_half(
                        weight, bags.values, bags.lengths, bags.weights, sparse_grad=True
                    )
                else:
                    pooled = F.embedding_bag(
                        bags.values,
                        weight,
                        bag_offsets(bags.lengths),
                        mode="sum",
                        per_sample_weights=bags.weights,
                        sparse=True,
                    )
                if config.pooling == "mean":
                    pooled = pooled / bags.lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)
                if bags.inverse_indices is not None:  # each bag pooled once, then expanded
                    pooled = pooled.index_select(0, bags.inverse_indices)
                outputs.append(pooled)
        return PooledEmbeddings(
            torch.cat(outputs, 1),
            self.feature_names,
            tuple(c.embedding_dim for c in self.configs for _ in c.feature_names),
        )


@eager_only("embedding input checks read ids back to the host")
def check_features(
    features: SparseFeatures,
    tables: Sequence[EmbeddingBagConfig] | FeatureCheck,
) -> SparseFeatures:
    """The batch with keys in the tables' feature order; every id a valid row of its table
    (tables with `raw_ids` take any int64 id: the collection maps them to rows next).
    `tables`: the configs, or their FeatureCheck, which a collection builds once and holds.
    Eager under torch.compile, as SparseFeatures' own validation."""
    if not isinstance(features, SparseFeatures):
        raise EmbeddingInputError(
            f"expected SparseFeatures, got {type(features).__name__}; build one with "
            "SparseFeatures.from_dict({'feature': [[ids of sample 0], ...]})"
        )
    spec = (tables if isinstance(tables, FeatureCheck) else FeatureCheck(tables)).spec
    expected = spec.features
    if features.keys != expected:
        unknown = [k for k in features.keys if k not in expected]
        if unknown:
            raise EmbeddingInputError(
                f"unknown features {unknown}: no table looks them up; the tables' features "
                f"are {list(expected)}"
            )
        missing = [k for k in expected if k not in features.keys]
        if missing:
            raise EmbeddingInputError(
                f"features {missing} are missing from the batch; every feature of the tables "
                "must be present (give a sample no ids with an empty bag)"
            )
        features = features.select(expected)
    if spec.checked and features.values.numel():
        _check_all_ids(features, spec)
    return features


@dataclass(frozen=True)
class _IdSpec:
    """What check_features needs of a collection's tables (FeatureCheck's)."""

    features: tuple[str, ...]  # every feature, in the tables' order
    configs: tuple[EmbeddingBagConfig, ...]  # each feature's table
    checked: bool  # whether any feature's ids must be rows (a table without raw_ids)
    raw: bool  # whether any feature's table takes raw ids (any int64)
    smallest: int  # the fewest rows of a checked table
    highest: torch.Tensor  # per feature: its largest valid id (int64 max for raw ids)
    lowers: torch.Tensor  # per feature: 0 (int64 min for raw ids)


class FeatureCheck:
    """What check_features needs of a collection's tables, derived once: the collection (or
    its sharded input shape) builds it with its tables and passes it every step."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig]) -> None:
        configs = tuple(c for c in tables for _ in c.feature_names)
        rows = [c.num_embeddings for c in configs if c.raw_ids is None]
        info = torch.iinfo(torch.int64)
        self.spec = _IdSpec(
            tuple(f for c in tables for f in c.feature_names),
            configs,
            bool(rows),
            len(rows) < len(configs),
            min(rows, default=0),
            torch.tensor(
                [info.max if c.raw_ids is not None else c.num_embeddings - 1 for c in configs]
            ),
            torch.tensor([info.min if c.raw_ids is not None else 0 for c in configs]),
        )


def _check_all_ids(features: SparseFeatures, spec: _IdSpec) -> None:
    """Every checked feature's ids in [0, rows of its table), in one pass over all features'
    ids; on a bad id, the first feature holding one raises _check_ids' error."""
    values = features.values
    low, high = values.aminmax()
    if not spec.raw and bool(low >= 0) and bool(high < spec.smallest):
        return  # the common case: one reduction for every table
    sizes = torch.tensor(features.feature_sizes(), device=values.device)
    total = values.numel()
    highest = spec.highest.to(values.device).repeat_interleave(sizes, output_size=total)
    bad = values > highest
    if spec.raw:
        lowers = spec.lowers.to(values.device).repeat_interleave(sizes, output_size=total)
        bad |= values < lowers
    else:
        bad |= values < 0
    if not bool(bad.any()):
        return
    position = int(bad.nonzero()[0])
    feature = int(torch.searchsorted(sizes.cumsum(0), position, right=True))
    start = int(sizes[:feature].sum())
    bags = bag_starts(features.bag_counts())
    _check_ids(
        values[start : start + int(sizes[feature])],
        features.lengths[bags[feature] : bags[feature + 1]],
        spec.features[feature],
        spec.configs[feature],
    )


def _check_ids(
    ids: torch.Tensor, lengths: torch.Tensor, feature: str, config: EmbeddingBagConfig
) -> None:
    low, high = ids.aminmax()
    if low >= 0 and high < config.num_embeddings:
        return
    bad_value = int(low if low < 0 else high)
    position = int((ids == bad_value).nonzero()[0])
    sample = int(torch.searchsorted(lengths.cumsum(0), position, right=True))
    raise EmbeddingInputError(
        f"feature {feature!r} (table {config.name!r}, {config.num_embeddings} rows): id "
        f"{bad_value} at position {position} of the feature's ids (sample {sample}) is "
        + ("negative" if bad_value < 0 else "out of range")
        + f"; ids must be in [0, {config.num_embeddings}). If these are raw ids, set "
        "EmbeddingBagConfig(raw_ids=HashIds(...)) or raw_ids=ManagedCollisions(...) on the "
        "table; otherwise hash or clamp them first"
    )
