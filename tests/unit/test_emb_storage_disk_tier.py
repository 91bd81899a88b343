"""The disk tier in one process: bad settings and paths, a materialized source, forward without
backward, and the planner putting tables on disk (a full disk: tests/e2e/test_disk_tier_full.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    SGD,
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
)
from manualpar.embeddings.planning.planner import plan_tables
from manualpar.errors import BuilderError, PlanError

TABLES = (EmbeddingBagConfig("big", 64, 4),)
ON_DISK = EmbeddingPlan(1, {"big": row_wise(on_disk=True)})


def _shard(ebc: EmbeddingBagCollection, tier: DiskTier | None) -> torch.nn.Module:
    return shard_embeddings(
        ebc, mp.ManualParallelStrategy(), ON_DISK, RowWiseAdagrad(lr=0.1), disk_tier=tier
    )


def _meta() -> EmbeddingBagCollection:
    with mp.empty_init():
        return EmbeddingBagCollection(TABLES, seed=1)


def test_disk_tier_settings_are_checked() -> None:
    with pytest.raises(BuilderError, match=re.escape("give exactly one of cache_rows=")):
        DiskTier("x")
    with pytest.raises(BuilderError, match=re.escape("cache_rows must be a positive int, got 0")):
        DiskTier("x", cache_rows=0)
    with pytest.raises(
        BuilderError, match=re.escape("policy must be one of ('lru', 'lfu', 'lrfu')")
    ):
        DiskTier("x", cache_rows=8, policy="fifo")
    with pytest.raises(
        BuilderError,
        match=re.escape(
            "DiskTier: write_log must be a number >= 0 (the write log's size in cache sizes; 0 "
            "for none), got -1"
        ),
    ):
        DiskTier("x", cache_rows=8, write_log=-1)
    assert DiskTier("x", cache_rows=8).policy == "lrfu"  # fewer misses than LRU, shifts too
    tier = DiskTier("x", cache_rows=8, write_log=2.5)
    # 2.5 caches of 8 slots, at most the block's rows
    assert (tier.log_rows(8, 1000), tier.log_rows(8, 12), DiskTier("x", 8).log_rows(8, 99)) == (
        20,
        12,
        32,
    )
    with pytest.raises(BuilderError) as error:
        _shard(_meta(), None)
    assert str(error.value) == (
        "the plan places tables ['big'] on disk, but no disk tier was given; pass "
        "shard_embeddings(..., disk_tier=DiskTier(directory, cache_bytes=...))"
    )


def test_a_directory_that_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file, not a directory")
    with pytest.raises(BuilderError) as error:
        _shard(_meta(), DiskTier(tmp_path / "blocker" / "tables", cache_rows=8))
    path = tmp_path / "blocker" / "tables" / "big.rows0.cols0.rank0.rows"
    assert str(error.value) == (
        f"disk tier: cannot write table 'big' (rank 0) file {str(path)!r}: Not a directory; "
        "give DiskTier(directory=...) a directory this process can write"
    )


def _batch(step: int) -> SparseFeatures:
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(step))
    return SparseFeatures(["big"], ids, torch.full((6,), 2, dtype=torch.int64))


def test_a_real_source_and_a_forward_without_backward(tmp_path: Path) -> None:
    """A materialized collection's values go to the file; no_grad forwards unpin their rows."""
    ebc = EmbeddingBagCollection(TABLES, seed=1)
    with torch.no_grad():
        ebc.tables["big"].weight.mul_(3)
    expected = ebc.tables["big"].weight.detach().clone()
    emb = shard_embeddings(
        ebc,
        mp.ManualParallelStrategy(),
        ON_DISK,
        SGD(lr=0.1),
        disk_tier=DiskTier(tmp_path, cache_rows=12),
    )
    with torch.no_grad():
        for step in range(10):  # 12 ids a step into 12 slots: only works if rows are unpinned
            pooled = emb(_batch(step)).values
    ids = _batch(9).values.view(6, 2)
    assert torch.equal(pooled, expected[ids].sum(1))
    with full_tensors():
        assert torch.equal(emb.state_dict()["tables.big.weight"], expected)


def test_the_planner_puts_the_largest_tables_on_disk_and_says_so() -> None:
    tables = [
        EmbeddingBagConfig("huge", 1_000_000, 64),
        EmbeddingBagConfig("large", 400_000, 64),
        EmbeddingBagConfig("small", 50_000, 64),
    ]
    budget = 60 * 2**20  # per rank; the three need 180 MiB each on 2 ranks
    with pytest.raises(PlanError, match="more than the budget"):
        plan_tables(tables, 2, memory_budget_bytes=budget)
    tier = DiskTier("unused", cache_bytes=16 * 2**20)
    plan = plan_tables(tables, 2, memory_budget_bytes=budget, disk_tier=tier)
    assert plan.tables["huge"] == row_wise(on_disk=True)
    assert plan.tables["large"] == row_wise(on_disk=True)
    assert not plan.tables["small"].on_disk
    text = plan.describe(tables)
    assert "row_wise on disk" in text
    assert "of which on disk: r0: 173.6 MiB, r1: 173.6 MiB" in text
    huge = next(line for line in text.splitlines() if line.startswith("  huge "))
    assert "(on disk: 248.0 MiB with the other tables exceed the 60.0 MiB budget per rank;" in huge
    assert EmbeddingPlan.from_json(plan.to_json()) == plan
    roomy = plan_tables(tables, 2, memory_budget_bytes=2**30, disk_tier=tier)
    assert not any(p.on_disk for p in roomy.tables.values())


def test_plan_auto_with_a_budget_puts_the_table_on_disk_and_trains(tmp_path: Path) -> None:
    """shard_embeddings(plan="auto") hands the disk tier to the planner; the cache_bytes split
    gives the one disk table the slots that fit beside the evicted rows being written (1/17)."""
    row = 4 * 4 + 4  # 4 floats + 1 row-wise state
    assert DiskTier(tmp_path, cache_bytes=24 * row).slots({"big": (1000, row)}) == {"big": 22}
    tier = DiskTier(tmp_path, cache_bytes=16 * row * 17 // 16)  # 16 slots
    # the table (64 rows: 1280 bytes) exceeds the budget; the cache, 340 bytes and 4 a block
    # row and 37 a slot of bookkeeping (1188 bytes), fits it
    emb = shard_embeddings(
        _meta(),
        mp.ManualParallelStrategy(),
        "auto",
        RowWiseAdagrad(lr=0.1),
        memory_budget_bytes=1200,
        disk_tier=tier,
    )
    assert emb.plan.tables["big"] == row_wise(on_disk=True)
    assert emb.tables["big"].weight.shape == (16, 4)
    for step in range(4):
        emb(_batch(step)).values.sum().backward()
    assert emb.storage.by_name["big"].cache.misses > 16


def test_the_planned_cache_memory_is_every_tensor_the_cache_allocates(tmp_path: Path) -> None:
    """What the planner counts for a disk table on a rank (DiskTier.cache_memory, and so the
    plan's memory per rank) is every tensor its cache holds: the slots' weights and optimizer
    state, and each per-row and per-slot tensor of its RowCache (`slot_of`: 4 bytes a block
    row, left out before: 297 MB a rank at the documented 36 GiB workload)."""
    from manualpar.embeddings.planning import Workload, load_topology, plan_costs, rule_costs

    tier = DiskTier(tmp_path, cache_rows=12)
    table = _shard(_meta(), tier).storage.by_name["big"]
    held = table.weight.nbytes + sum(state.nbytes for state in table.state.values())
    held += sum(t.nbytes for t in vars(table.cache).values() if isinstance(t, torch.Tensor))
    row = 4 * 4 + 4  # 4 floats + 1 row-wise state
    assert held == 12 * row + 64 * 4 + 12 * 37
    # and the evicted rows' records on their way to the file, copied out of the cache: up to a
    # 1/16 of its slots, rounded up (BackgroundWrites; cache_bytes= keeps room for them)
    planned = held + 1 * row
    assert tier.cache_memory({"big": (64, row)}) == planned
    state, full_rows = rule_costs(None)
    workload = Workload(6, state=state, full_rows=full_rows)
    costs = plan_costs(list(TABLES), ON_DISK, load_topology("cpu-host", 1), workload, tier)
    assert costs.memory.tolist() == [planned]


def test_a_replaced_cache_weight_stops_the_next_step(tmp_path: Path) -> None:
    """A disk table's weight is its row cache: a same-shape replacement was taken, and the step
    looked up the new tensor's slots (never filled) while checkpoints saved the old rows."""
    emb = _shard(_meta(), DiskTier(tmp_path, cache_rows=12))
    emb.tables["big"].weight = torch.nn.Parameter(torch.zeros(12, 4))
    with pytest.raises(BuilderError) as error:
        emb(_batch(0))
    assert str(error.value) == (
        "shard_embeddings: table 'big' on rank 0: its weight was replaced, but the table is on "
        "the disk tier: the weight is its row cache (12 x 4 slots the tier fills from its file), "
        "so the step would look up slots of the new tensor the tier never fills, and checkpoints "
        "would save the old rows. Write new rows through a checkpoint load (the disk tier loads "
        "them into its file), or build the collection again with shard_embeddings() from a "
        "collection holding the new rows"
    )
