"""shard_embeddings: split an EmbeddingBagCollection over the ranks, with a fused optimizer.

    emb = shard_embeddings(model.emb, strategy, plan="auto", rule=RowWiseAdagrad(lr=0.05))
    pooled = emb(features)            # (local batch, sum of dims); differentiable
    loss.backward()                   # the tables are updated here, inside backward

Gradient semantics, as DDP's: each rank's loss is over its local batch and a table's gradient is
the average over ranks (the gradient of the global-batch mean), so tables and DDP parts agree.
`normalize_by="global_samples"` weights each rank by its share of the global batch instead, as
`ddp(normalize_by="global_samples")`, for variable per-rank batches. Every rank must run forward
and backward the same number of times (each is a collective), as with DDP.

An EmbeddingBagCollection becomes a ShardedEmbeddingBagCollection (sharded/bag_collection.py);
an EmbeddingCollection (one row per id) a ShardedEmbeddingCollection
(sharded/sequence_collection.py), each id a bag of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, overload

import torch

from manualpar import deprecated
from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.modules.bag_collection import EmbeddingBagCollection
from manualpar.embeddings.modules.sequence_collection import EmbeddingCollection
from manualpar.embeddings.optim.update_rules import UpdateRule
from manualpar.embeddings.plan import EmbeddingPlan, TablePlacement
from manualpar.embeddings.sharded.bag_collection import ShardedEmbeddingBagCollection
from manualpar.embeddings.sharded.sequence_collection import ShardedEmbeddingCollection
from manualpar.embeddings.sharded.table_storage import check_disk_plan
from manualpar.embeddings.step.finite_check import check_mode
from manualpar.embeddings.step.table_mesh import TableMesh, table_mesh
from manualpar.embeddings.step.wire import WireDtypes, wire_dtypes
from manualpar.embeddings.storage.disk_tier import DiskTier
from manualpar.errors import BuilderError, PlanError
from manualpar.ownership import claim, mark_replaced

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from manualpar.strategy import ManualParallelStrategy

__all__ = ["shard_embeddings"]

NORMALIZATIONS = ("world_size", "global_samples")  # the spellings ddp() takes


@overload
def shard_embeddings(
    ebc: EmbeddingCollection,
    strategy: ManualParallelStrategy,
    plan: EmbeddingPlan | Mapping[str, TablePlacement] | str = "auto",
    rule: UpdateRule | None = None,
    *,
    memory_budget_bytes: int | None = None,
    normalize_by: str = "world_size",
    mesh: DeviceMesh | None = None,
    disk_tier: DiskTier | None = None,
    non_finite: str = "raise",
    guard_half_rows: bool | None = None,
    wire_dtype: torch.dtype | WireDtypes | str | None = None,
    pinned: Mapping[str, TablePlacement] | None = None,
    optimizer: UpdateRule | None = None,
) -> ShardedEmbeddingCollection: ...


@overload
def shard_embeddings(
    ebc: EmbeddingBagCollection,
    strategy: ManualParallelStrategy,
    plan: EmbeddingPlan | Mapping[str, TablePlacement] | str = "auto",
    rule: UpdateRule | None = None,
    *,
    memory_budget_bytes: int | None = None,
    normalize_by: str = "world_size",
    mesh: DeviceMesh | None = None,
    disk_tier: DiskTier | None = None,
    non_finite: str = "raise",
    guard_half_rows: bool | None = None,
    wire_dtype: torch.dtype | WireDtypes | str | None = None,
    pinned: Mapping[str, TablePlacement] | None = None,
    optimizer: UpdateRule | None = None,
) -> ShardedEmbeddingBagCollection: ...


def shard_embeddings(
    ebc: EmbeddingBagCollection | EmbeddingCollection,
    strategy: ManualParallelStrategy,
    plan: EmbeddingPlan | Mapping[str, TablePlacement] | str = "auto",
    rule: UpdateRule | None = None,
    *,
    memory_budget_bytes: int | None = None,
    normalize_by: str = "world_size",
    mesh: DeviceMesh | None = None,
    disk_tier: DiskTier | None = None,
    non_finite: str = "raise",
    guard_half_rows: bool | None = None,
    wire_dtype: torch.dtype | WireDtypes | str | None = None,
    pinned: Mapping[str, TablePlacement] | None = None,
    optimizer: UpdateRule | None = None,
) -> ShardedEmbeddingBagCollection | ShardedEmbeddingCollection:
    """Shard `ebc` (meta or materialized) by `plan` and train it with the update `rule`
    (SGD, Adagrad, RowWiseAdagrad, Adam), which the fused optimizer applies in backward;
    `optimizer=`, its name before 0.3, still works with a warning.

    `plan`: "auto" (the planner; `memory_budget_bytes` per rank), an EmbeddingPlan, or a
    mapping table name -> placement for this world size. Meta tables are initialized per shard
    with the values the unsharded collection would have; real tables are copied block by block.

    `mesh`: None (every rank of the job), or a 2-D `strategy.mesh(replicate=R, shard=S)`: dim 0
    replicates, dim 1 shards (names are free); the plan is then for S ranks, each row of the
    mesh holds a sharded copy, ids travel only within a row and the rows' table gradients are
    summed before the update (table_mesh.py). The tables train to the numbers of a 1-D
    collection over all R x S ranks.

    `disk_tier`: DiskTier(directory, cache_rows= or cache_bytes=, policy=) for tables the plan
    places `on_disk` (and, with plan="auto", for those the budget cannot hold): their rows live
    in files, each rank caching the rows in use (disk_tier.py).

    `pinned` (with plan="auto"): {table: placement} the planner keeps as given, planning the
    others around them, e.g. `pinned={"ads": row_wise(on_disk=True)}` with `disk_tier=`.

    `non_finite`: what a step whose output gradient holds NaN or inf does, on every rank
    alike, before any row changes: "raise" (NonFiniteError naming tables, ranks and counts) or
    "skip" (drop the sparse update and count it in `skipped_updates`; step/finite_check.py).

    `guard_half_rows`: in a collection with float16/bfloat16 tables, refuse an update that
    would overflow their rows to inf or NaN on any rank, leaving every rank's rows and state
    as before (then `non_finite` decides: NonFiniteError, or a counted skip). None (the
    default): on where the rule's step is bounded (SGD, Adagrad, RowWiseAdagrad, Adam with
    b2 > 0), where it costs nothing measurable (the touched rows are copied aside only when a
    rank's bound cannot rule an overflow out); True: also for Adam with b2 = 0, copying the
    touched rows and state every step; False: off (step/half_overflow.py).

    `wire_dtype`: the dtype the pooled outputs and output gradients travel in between ranks
    (None: float32), one for both or `WireDtypes(forward=torch.float16, backward=
    torch.bfloat16)`: forward float16, bfloat16 or float8 (e4m3fn, e5m2), backward bfloat16;
    the sums and updates stay float32, each travelling value is rounded once (step/wire.py;
    docs/embeddings-training.md, "Half-precision exchanges"). None with a plan that records
    a wire (`EmbeddingPlan.wire`, the planner's pick) takes the plan's.
    """
    if not isinstance(ebc, EmbeddingBagCollection | EmbeddingCollection):
        raise BuilderError(
            f"{BUILDER}() takes an EmbeddingBagCollection or an EmbeddingCollection, got "
            f"{type(ebc).__name__}"
        )
    rule = deprecated.renamed_keyword("shard_embeddings(optimizer=...)", rule, optimizer, "rule=")
    if rule is None:
        raise BuilderError(
            f"{BUILDER}(): pass rule=SGD/Adagrad/RowWiseAdagrad/Adam(lr=...);"
            " sharded tables are updated by a fused optimizer inside backward"
        )
    converted = {
        name: (table.weight.dtype, table.config.dtype)
        for name, table in ebc.tables.items()
        if table.weight.dtype != table.config.dtype
    }
    if converted:
        name, (dtype, configured) = next(iter(converted.items()))
        raise BuilderError(
            f"{BUILDER}(): table {name!r} is {dtype} but its config says {configured} (tables: "
            f"{sorted(converted)}); sharded tables hold rows in their config's dtype, and "
            "converting silently would ignore your .to(). Undo the .to(dtype) on the collection "
            "(convert only the dense parts) and set EmbeddingBagConfig(dtype=torch.float16 or "
            "torch.bfloat16) for half-precision rows; lookups return float32 either way"
        )
    normalize_by = deprecated.normalize_by(normalize_by)
    if normalize_by not in NORMALIZATIONS:
        raise BuilderError(
            f"{BUILDER}(): normalize_by must be one of {NORMALIZATIONS}, got {normalize_by!r}"
        )
    non_finite = check_mode(non_finite)
    wire = wire_dtypes(wire_dtype)
    layout = table_mesh(mesh, strategy)
    if pinned is not None and not isinstance(plan, str):
        raise PlanError(
            f"pinned= is for plan='auto'; with an explicit plan, put the pinned tables "
            f"{sorted(pinned)} in the plan itself"
        )
    if isinstance(plan, str):
        if plan != "auto":
            raise PlanError(f"plan must be 'auto', an EmbeddingPlan or a mapping, got {plan!r}")
        plan = _auto_plan(ebc, strategy, rule, memory_budget_bytes, layout, disk_tier, pinned)
    elif not isinstance(plan, EmbeddingPlan):
        plan = EmbeddingPlan(layout.shard_size, dict(plan))
    layout.check_plan_size(plan.world_size)
    plan.validate(ebc.configs, layout.shard_size)
    if wire_dtype is None and plan.wire is not None:  # the planner's pick (wire_dtypes=)
        wire = wire_dtypes(plan.wire)
    check_disk_plan(plan, disk_tier, layout.replicate is not None)
    claim(ebc, BUILDER)
    settings = (strategy, plan, rule, normalize_by, layout, disk_tier, non_finite)
    sharded: ShardedEmbeddingBagCollection | ShardedEmbeddingCollection = (
        ShardedEmbeddingCollection(ebc, *settings)
        if isinstance(ebc, EmbeddingCollection)
        else ShardedEmbeddingBagCollection(ebc, *settings)
    )
    if guard_half_rows is not False:
        sharded.step.backward_phases.guard_half_rows(copy_always=guard_half_rows is True)
    sharded.step.use_wire(wire)
    mark_replaced(ebc.parameters(), BUILDER)
    return sharded


def _auto_plan(
    ebc: EmbeddingBagCollection | EmbeddingCollection,
    strategy: ManualParallelStrategy,
    rule: UpdateRule,
    budget: int | None,
    layout: TableMesh,
    disk_tier: DiskTier | None = None,
    pinned: Mapping[str, TablePlacement] | None = None,
) -> EmbeddingPlan:
    """The planner's plan for the shard group, within `budget` bytes per rank; by default the
    memory every rank can still allocate, so a table that cannot fit is named before anything
    is allocated."""
    from manualpar.embeddings.planning import plan_collections

    plans = plan_collections(
        {"tables": ebc},
        strategy,
        memory_budget_bytes=budget,
        rule=rule,
        mesh=layout.shard if layout.replicate is not None else None,
        disk_tier=disk_tier,
        pinned=pinned,
    )
    return plans["tables"]
