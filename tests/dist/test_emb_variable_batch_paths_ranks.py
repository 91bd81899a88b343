"""A batch per feature (variable_batch_cases.py) through the step's other paths, on 2 gloo ranks:
raw-id tables (ManagedCollisions remapped at their owner and through the remap exchange,
HashIds), a disk tier whose next batch's rows TrainPipeline reads ahead, and the table batch
(ShardedStep.batches_tables). Each equals the same model fed the expanded batch: the first
step's pooled outputs bit for bit, the tables, optimizer state and later outputs within float32
rounding (the gradient of a bag is summed over its samples before it travels), the remappers'
state equal (a raw-id table's features are expanded before their remap, which counts each
sample's read: ids/managed_collisions.managed_per_sample).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from embedding_cases import SEED, STEPS, TABLES, local_loss
from variable_batch_cases import variable_batch

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    column_wise,
    data_parallel,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.kernels.native import native_kernels
from manualpar.testing import run_distributed

BATCHES = [5, 3]
# t0 and t1 remapped at their blocks' owners, t2 (replicated) through the remap exchange
RAW_IDS = {
    "t0": mp.ManagedCollisions(bucket_rows=10),
    "t1": mp.ManagedCollisions(bucket_rows=4),
    "t2": mp.ManagedCollisions(bucket_rows=8),
    "t4": mp.HashIds(),
}


def _plan(world: int, disk: bool = False) -> EmbeddingPlan:
    return EmbeddingPlan(
        world,
        {
            "t0": table_wise(world - 1, on_disk=disk),
            "t1": row_wise(on_disk=disk),
            "t2": data_parallel() if not disk else table_wise(0),
            "t3": table_wise(0),
            "t4": column_wise((0, world - 1)) if world > 1 else table_wise(0),
            "t5": row_wise(),
        },
    )


def _train(emb: Any, batches: list[SparseFeatures], strategy: Any, piped: bool) -> dict[str, Any]:
    loop = mp.TrainPipeline(iter(batches), strategy, emb.prefetch) if piped else batches
    disk = [table.cache for table in emb.storage.by_name.values() if hasattr(table, "cache")]
    outputs, pinned = [], []
    for step, features in enumerate(loop):
        pinned.append(sum(cache.pinned for cache in disk))  # rows read ahead for this step
        pooled = emb(features).values
        outputs.append(pooled.detach().clone())
        local_loss(pooled, strategy.rank, step).backward()
    with full_tensors():
        tables = {k: v.clone() for k, v in emb.state_dict().items()}
        state = emb.fused_optimizer.state_dict()["state"]
    return {"outputs": outputs, "tables": tables, "state": state, "pinned": pinned}


def _twins(
    strategy: Any, plan: EmbeddingPlan, raw_ids: bool, tier: str | None, batched: bool
) -> list[Any]:
    """The same sharded model twice: for the variable batches and for their expansions."""
    tables = [
        dataclasses.replace(t, raw_ids=RAW_IDS[t.name]) if raw_ids and t.name in RAW_IDS else t
        for t in TABLES
    ]
    twins = []
    for twin in ("variable", "expanded"):
        with mp.empty_init():
            ebc = EmbeddingBagCollection(tables, seed=SEED)
        disk = None if tier is None else DiskTier(f"{tier}/{twin}", cache_rows=32)
        emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.3), disk_tier=disk)
        emb.step.batches_tables = batched
        twins.append(emb)
    return twins


def _counted(lookup: Any, taken: list[int]) -> Any:
    """`lookup` (the step's table-batch lookup), counting its calls in `taken`."""

    def counting(*args: Any) -> Any:
        taken.append(1)
        return lookup(*args)

    return counting


def _paths(directory: str) -> dict[str, Any]:
    strategy = mp.ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    variable = [variable_batch(rank, step, BATCHES[rank]) for step in range(STEPS)]
    expanded = [features.expand() for features in variable]
    results: dict[str, Any] = {}
    cases = {
        "raw ids": (_plan(world), True, None, False, False),
        "raw ids, pipelined": (_plan(world), True, None, False, True),
        "disk tier, rows read ahead": (_plan(world, disk=True), False, directory, False, True),
        "table batch": (
            EmbeddingPlan(world, {t.name: table_wise(i % world) for i, t in enumerate(TABLES)}),
            False,
            None,
            True,
            False,
        ),
    }
    for name, (plan, raw_ids, tier, batched, piped) in cases.items():
        emb, twin = _twins(strategy, plan, raw_ids, tier and f"{tier}/{name}", batched)
        taken: list[int] = []
        phases = twin.step.forward_phases
        phases._lookup_batched = _counted(phases._lookup_batched, taken)  # type: ignore[method-assign]
        results[name] = {
            "variable": _train(emb, variable, strategy, piped),
            "expanded": _train(twin, expanded, strategy, piped),
            "batched steps": len(taken),
        }
    strategy.teardown()
    return results


@pytest.mark.timeout(150)
def test_raw_ids_a_disk_tier_read_ahead_and_the_table_batch_equal_the_expanded_batch(
    tmp_path: Path,
) -> None:
    per_rank = run_distributed(_paths, 2, args=(str(tmp_path),), timeout=120)
    for rank, results in enumerate(per_rank):
        for name, runs in results.items():
            got, twin = runs["variable"], runs["expanded"]
            where = f"{name}, rank {rank}"
            for step, (out, expected) in enumerate(
                zip(got["outputs"], twin["outputs"], strict=True)
            ):
                if step == 0:  # the same ids pooled by the same kernel, then copied
                    assert torch.equal(out, expected), f"{where}: pooled output of step 0"
                else:  # from tables within float32 rounding of each other
                    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5, msg=where)
            assert got["tables"].keys() == twin["tables"].keys()
            for key, value in twin["tables"].items():
                if value.is_floating_point():
                    torch.testing.assert_close(
                        got["tables"][key], value, rtol=0, atol=1e-6, msg=where
                    )
                else:  # the remappers' state: ids, last seen, counts
                    assert torch.equal(got["tables"][key], value), f"{where}: {key}"
            for table, state in twin["state"].items():
                for key, value in state.items():
                    torch.testing.assert_close(
                        got["state"][table][key], value, rtol=1e-5, atol=1e-6, msg=where
                    )
        # over the disk tier every step's rows were read ahead, for the variable batch too
        assert all(results["disk tier, rows read ahead"]["variable"]["pinned"])
        if native_kernels() is not None:  # the expanded batch takes the table batch
            assert results["table batch"]["batched steps"] == STEPS
