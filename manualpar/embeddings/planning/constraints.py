"""What a plan must respect (`PlanConstraints`) and what it is priced for (`PlanOptions`).

    plan_tables(tables, 8, PlanConstraints(memory_budget_bytes=2 * 2**30,
                                           pinned={"ads": row_wise(on_disk=True)},
                                           disk_tier=DiskTier("runs/tables", cache_bytes=2**30)))

The planner's stages read these two objects; `plan_tables` and `plan_collections` still take
each field as a keyword (`plan_tables(tables, 8, memory_budget_bytes=...)`), and the keywords
of earlier versions map to fields with a warning (manualpar/deprecated.py): `method=` to
`PlanOptions.price`, `optimizer=` to `PlanOptions.rule`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from manualpar.deprecated import warn_deprecated
from manualpar.embeddings.exchange_layout import (
    BACKWARD_DTYPES,
    FLOAT32_WIRE,
    FORWARD_DTYPES,
    WIRE_NAMES,
    WireDtypes,
)
from manualpar.embeddings.optim.update_rules import UpdateRule
from manualpar.embeddings.plan import TablePlacement
from manualpar.embeddings.planning.topology import Topology
from manualpar.embeddings.storage.cached_tier import CachedTier
from manualpar.errors import ConfigTypeError, PlanError

__all__ = [
    "PRICES",
    "CollectionKeywords",
    "PlanConstraints",
    "PlanKeywords",
    "PlanOptions",
    "resolve",
]

# "time": the cost model's predicted step time on the topology (the default); "memory": memory
# and lookups balanced per rank, without a topology (the placement by size of earlier versions)
PRICES = ("time", "memory")
_METHODS = {"cost": "time", "memory": "memory"}  # method= before 0.3 -> price


@dataclass(frozen=True)
class PlanConstraints:
    """What every plan must respect.

    `memory_budget_bytes`: per rank, for weights, optimizer state, caches and the managed-
    collision remappers' state (None: no limit). `pinned`: {table: placement} kept as given
    (on disk too, with a `disk_tier`), the others planned around them. `dtypes`: the row dtypes
    a table may be stored in, most precise first (plan_by_cost: a table takes a less precise one
    only where memory forces it, before disk; empty: each table's own). `disk_tier`: where
    tables may go when memory runs out (a storage tier with a cache, e.g. DiskTier).
    `replicate_bytes`: the largest table (weights + state) that may be replicated (None: 64 MiB
    when priced by time, 256 KiB by memory). `wire_dtypes`: the dtypes a collection's pooled
    outputs and gradients may travel in (WireDtypes, a torch dtype for both, or a short name:
    "fp32", "bf16", "fp16", "fp8"), most precise first; priced by time, each collection takes
    the one its predicted step is fastest with, the more precise on a tie, recorded in its
    plan (EmbeddingPlan.wire). Empty: float32, recorded nowhere (plans as before)."""

    memory_budget_bytes: int | None = None
    pinned: Mapping[str, TablePlacement] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = ()
    disk_tier: CachedTier | None = None
    replicate_bytes: int | None = None
    wire_dtypes: tuple[WireDtypes | torch.dtype | str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire_dtypes", tuple(_wire(w) for w in self.wire_dtypes))

    @property
    def wires(self) -> tuple[WireDtypes, ...]:
        """The wire dtypes allowed (float32 alone unless told)."""
        return tuple(w for w in self.wire_dtypes if isinstance(w, WireDtypes)) or (FLOAT32_WIRE,)


@dataclass(frozen=True)
class PlanOptions:
    """The machine and the step a plan is priced for, and the price the search minimizes.

    `price`: "time" (the slowest rank's predicted step time on `topology`, default: see
    default_topology) or "memory" (memory and lookups balanced per rank). `batch_per_rank`
    samples a rank per step, `pooling_factors` ({table: mean ids per bag}) ids a sample, drawn
    uniformly or with Zipf(`skew`) popularity; `bags_per_feature` ({feature: bags a rank per
    step}) the features of a batch per feature (SparseFeatures.bags_per_key), priced by their
    own bags (the time price; the memory price does not count bags); `rule`: the update rule
    whose state counts (row-wise Adagrad if None). `replicas` > 1: the plan is for the shard
    dim of a replicas x world_size mesh."""

    price: str = "time"
    topology: Topology | None = None
    ranks_per_node: int | None = None
    replicas: int = 1
    batch_per_rank: int | None = None
    pooling_factors: Mapping[str, float] | None = None
    bags_per_feature: Mapping[str, float] | None = None
    skew: float = 0.0
    rule: UpdateRule | None = None


class CollectionKeywords(TypedDict, total=False):
    """The fields of PlanConstraints and PlanOptions as plan_collections' keywords (its update
    rule and ids per bag may differ per collection, so they are its own), and `method`."""

    memory_budget_bytes: int | None
    pinned: Mapping[str, TablePlacement] | None
    dtypes: tuple[torch.dtype, ...]
    disk_tier: CachedTier | None
    replicate_bytes: int | None
    wire_dtypes: tuple[WireDtypes | torch.dtype | str, ...]
    price: str
    topology: Topology | None
    ranks_per_node: int | None
    replicas: int
    batch_per_rank: int | None
    bags_per_feature: Mapping[str, float] | None
    skew: float
    method: str  # before 0.3: "cost" (price="time") or "memory"


class PlanKeywords(CollectionKeywords, total=False):
    """The fields of PlanConstraints and PlanOptions as plan_tables' keywords, `method` and
    `optimizer`."""

    pooling_factors: Mapping[str, float] | None
    rule: UpdateRule | None
    optimizer: UpdateRule | None  # before 0.3: rule


def resolve(
    where: str,
    constraints: PlanConstraints | None,
    options: PlanOptions | None,
    keywords: Mapping[str, Any],
) -> tuple[PlanConstraints, PlanOptions]:
    """The constraints and options of a call to `where`: the objects given, each keyword set on
    the one that has its field (a keyword at its default changes nothing). A field given both
    ways is refused, as is an unknown keyword."""
    constraints = constraints or PlanConstraints()
    options = options or PlanOptions()
    keywords = dict(keywords)
    if "method" in keywords:
        keywords["price"] = _price_of_method(where, keywords.pop("method"), keywords)
    if "optimizer" in keywords:
        keywords["rule"] = _rule_of_optimizer(where, keywords.pop("optimizer"), keywords)
    for name, value in keywords.items():
        target = _owner(where, name, constraints, options)
        default = _default(type(target), name)
        if name == "pinned":
            value = dict(value or {})  # (None: none)
        elif name in ("dtypes", "wire_dtypes"):
            value = tuple(value or ())
        if value == default:
            continue  # a keyword left at its default changes nothing
        if getattr(target, name) != default:
            raise ConfigTypeError(
                f"{where}: {name}= was given twice, as a keyword and in the "
                f"{type(target).__name__}; pass it once"
            )
        if target is constraints:
            constraints = dataclasses.replace(constraints, **{name: value})
        else:
            options = dataclasses.replace(options, **{name: value})
    if options.price not in PRICES:
        raise PlanError(f"{where}: price must be one of {PRICES}, got {options.price!r}")
    return constraints, options


def _price_of_method(where: str, method: object, keywords: Mapping[str, Any]) -> str:
    if "price" in keywords:
        raise ConfigTypeError(f"{where}: pass price= alone; method= is its spelling before 0.3")
    if method not in _METHODS:
        raise PlanError(f"plan method must be one of {tuple(_METHODS)}, got {method!r}")
    warn_deprecated(f"{where.split('(')[0]}(method=...)", stacklevel=5)
    return _METHODS[str(method)]


def _rule_of_optimizer(where: str, optimizer: object, keywords: Mapping[str, Any]) -> object:
    if keywords.get("rule") is not None:
        raise ConfigTypeError(f"{where}: pass rule= alone; optimizer= is its spelling before 0.3")
    warn_deprecated(f"{where.split('(')[0]}(optimizer=...)", stacklevel=5)
    return optimizer


def _owner(
    where: str, name: str, constraints: PlanConstraints, options: PlanOptions
) -> PlanConstraints | PlanOptions:
    for target in (constraints, options):
        if name in {f.name for f in dataclasses.fields(target)}:
            return target
    known = sorted(PlanKeywords.__annotations__)
    raise ConfigTypeError(f"{where} got an unexpected keyword argument {name!r}; it takes {known}")


def _default(kind: type, name: str) -> object:
    """The field's default; `name` is a field of `kind` (`_owner` found it there)."""
    spec = {field.name: field for field in dataclasses.fields(kind)}[name]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def _wire(value: object) -> WireDtypes:
    """One allowed wire dtype as WireDtypes; PlanError for one an exchange cannot carry."""
    if isinstance(value, str) and value in WIRE_NAMES:
        return WIRE_NAMES[value]
    wire = WireDtypes(value, value) if isinstance(value, torch.dtype) else value
    if (
        not isinstance(wire, WireDtypes)
        or wire.forward not in FORWARD_DTYPES
        or wire.backward not in BACKWARD_DTYPES
    ):
        raise PlanError(
            f"wire_dtypes: {value!r} is not a wire dtype the exchanges carry; give short names "
            f"{sorted(WIRE_NAMES)} or WireDtypes(forward=, backward=) with forward one of "
            f"{[str(d) for d in FORWARD_DTYPES]} and backward one of "
            f"{[str(d) for d in BACKWARD_DTYPES]}"
        )
    return wire


def refuse_dtypes(where: str, limits: PlanConstraints) -> None:
    """An EmbeddingPlan holds placements only: the dtype each table stores its rows in is what
    plan_by_cost returns beside its plan (CostPlan.dtypes)."""
    if limits.dtypes:
        raise PlanError(
            f"{where}: dtypes= changes how tables store their rows, which an EmbeddingPlan "
            "cannot say; call plan_by_cost(..., constraints=PlanConstraints(dtypes=...)) and "
            "store each table in CostPlan.dtypes' dtype"
        )
