"""The planner's disk rule (largest tables to disk, in order, until the rest plus the caches fit),
tables pinned to a placement, and the disk tier's refusal on a 2-D mesh."""

from __future__ import annotations

import pytest

from manualpar.embeddings import DiskTier, EmbeddingBagConfig, row_wise, table_wise
from manualpar.embeddings.planning import plan_collections, plan_tables
from manualpar.errors import PlanError

MB = 10**6
# with row-wise Adagrad: 20M x 17 x 4 = 1.36 GB, 10M x 17 x 4 = 680 MB
TABLES = [EmbeddingBagConfig("mid", 10_000_000, 16), EmbeddingBagConfig("big", 20_000_000, 16)]


def _tier(tmp_path) -> DiskTier:  # type: ignore[no-untyped-def]
    return DiskTier(tmp_path, cache_bytes=64 * 2**20)


@pytest.mark.parametrize("price", ["time", "memory"])
@pytest.mark.parametrize(
    ("world", "budget"),
    [(1, 1400 * MB), (1, 1500 * MB), (2, 700 * MB)],
    ids=["1-rank-only-largest-fits", "1-rank-either-fits", "2-ranks-only-largest-fits"],
)
def test_the_largest_table_goes_to_disk_first(tmp_path, price, world, budget) -> None:  # type: ignore[no-untyped-def]
    plan = plan_tables(
        TABLES, world, memory_budget_bytes=budget, disk_tier=_tier(tmp_path), price=price
    )
    assert plan.tables["big"] == row_wise(on_disk=True)
    assert not plan.tables["mid"].on_disk
    assert plan.notes["big"].startswith("on disk: 1.27 GiB with the other tables exceed the ")


def test_a_pinned_table_keeps_its_placement_and_the_rest_is_planned_around_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tables = [*TABLES, EmbeddingBagConfig("small", 100_000, 16)]
    for price in ("time", "memory"):
        plan = plan_tables(
            tables,
            2,
            memory_budget_bytes=1200 * MB,
            disk_tier=_tier(tmp_path),
            pinned={"mid": row_wise(on_disk=True)},
            price=price,
        )
        assert plan.tables["mid"] == row_wise(on_disk=True), price
        assert not plan.tables["big"].on_disk and not plan.tables["small"].on_disk, price
        assert plan.notes["mid"] == "pinned: row_wise on disk", price
    # pinned in memory: the whole table on rank 1, counted there (the big one cannot join it)
    plan = plan_tables(tables, 2, memory_budget_bytes=1400 * MB, pinned={"mid": table_wise(1)})
    assert plan.tables["mid"] == table_wise(1) and plan.notes["mid"] == "pinned: table_wise[1]"
    assert plan.tables["big"] != table_wise(1)


def test_pinning_is_checked_before_planning(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError, match=r"^pinned= names tables \['nope'\] that are not planned"):
        plan_tables(TABLES, 2, pinned={"nope": row_wise()})
    with pytest.raises(
        PlanError,
        match=r"^pinned= puts tables \['big'\] on disk, but no disk tier was given; pass "
        r"disk_tier=DiskTier\(directory, cache_bytes=\.\.\.\)",
    ):
        plan_tables(TABLES, 2, pinned={"big": row_wise(on_disk=True)})
    with pytest.raises(PlanError, match=r"^table 'big' \(table_wise\[2\]\): ranks \[2\] do not"):
        plan_tables(TABLES, 2, pinned={"big": table_wise(2)})


def test_a_2d_mesh_refuses_the_disk_tier_before_any_budget_failure(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(
        PlanError,
        match=r"^the disk tier does not support a 2-D mesh \(2 replicated shard groups\)",
    ):
        plan_tables(TABLES, 2, memory_budget_bytes=MB, disk_tier=_tier(tmp_path), replicas=2)


def test_plan_collections_pins_by_the_names_in_its_notes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plans = plan_collections(
        {"user": TABLES[:1], "item": TABLES[1:]},
        2,
        memory_budget_bytes=1200 * MB,
        disk_tier=_tier(tmp_path),
        pinned={"user.mid": row_wise(on_disk=True)},
    )
    assert plans["user"].tables["mid"] == row_wise(on_disk=True)
    assert not plans["item"].tables["big"].on_disk


def test_shard_embeddings_auto_keeps_a_pinned_table_on_disk(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import manualpar as mp
    from manualpar.embeddings import EmbeddingBagCollection, RowWiseAdagrad, shard_embeddings

    with mp.empty_init():
        ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig("a", 64, 4), EmbeddingBagConfig("b", 32, 4)], seed=1
        )
    sharded = shard_embeddings(
        ebc,
        mp.ManualParallelStrategy(),
        "auto",
        RowWiseAdagrad(lr=0.1),
        disk_tier=DiskTier(tmp_path, cache_rows=8),
        pinned={"a": row_wise(on_disk=True)},
    )
    assert sharded.plan.tables["a"] == row_wise(on_disk=True)
    assert not sharded.plan.tables["b"].on_disk


def test_the_planner_prices_a_tier_through_the_storage_interface(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Any tier with `slots` and `cache_memory` (storage/cached_tier.py) is planned like the
    disk tier: its cache counts against the budget and in the costs."""
    from manualpar.embeddings.planning import Workload as PlanWorkload
    from manualpar.embeddings.planning import load_topology, plan_costs, rule_costs

    cached_bytes = 64 * 2**20
    assert DiskTier(tmp_path, cache_bytes=cached_bytes).cache_memory({}) == 0
    # the slots' rows, plus 4 bytes a block row and 37 a slot of bookkeeping (row_cache.py)
    index = 10 * 4 + 10 * 37
    assert DiskTier(tmp_path, cache_bytes=cached_bytes).cache_memory({"t": (10, 8)}) == (
        cached_bytes + index
    )
    blocks = {"a": (10, 8), "b": (2, 100)}
    index = 10 * 4 + 4 * 37 + 2 * 4 + 2 * 37
    in_flight = 8 + 100  # a 1/16 of each block's slots, rounded up: evicted, on the way out
    assert DiskTier(tmp_path, cache_rows=4).cache_memory(blocks) == 232 + in_flight + index

    class HalfRows:  # a tier caching half of every block
        def slots(self, blocks):  # type: ignore[no-untyped-def]
            return {name: rows // 2 for name, (rows, _) in blocks.items()}

        def cache_memory(self, blocks):  # type: ignore[no-untyped-def]
            return sum(rows // 2 * width for rows, width in blocks.values())

    plan = plan_tables(
        TABLES,
        2,
        memory_budget_bytes=1200 * MB,
        disk_tier=HalfRows(),
        pinned={"big": row_wise(on_disk=True)},
    )
    assert plan.tables["big"] == row_wise(on_disk=True) and not plan.tables["mid"].on_disk
    state, full_rows = rule_costs(None)
    costs = plan_costs(
        TABLES,
        plan,
        load_topology("cpu-host", 2),
        PlanWorkload(64, state=state, full_rows=full_rows),
        HalfRows(),
    )
    big_block = 10_000_000 * 17 * 4  # a rank's half of big: rows x (16 floats + 1 state)
    mid_block = 5_000_000 * 17 * 4
    assert costs.memory.tolist() == [big_block / 2 + mid_block] * 2
    assert costs.disk.tolist() == [big_block] * 2


def test_a_table_pinned_on_disk_without_a_budget_plans_the_rest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = plan_tables(TABLES, 2, disk_tier=_tier(tmp_path), pinned={"big": row_wise(on_disk=True)})
    assert plan.tables["big"] == row_wise(on_disk=True) and not plan.tables["mid"].on_disk


@pytest.mark.parametrize("price", ["time", "memory"])
def test_the_caches_bookkeeping_counts_against_the_budget(tmp_path, price) -> None:  # type: ignore[no-untyped-def]
    """A disk block's cache keeps 4 bytes for each of its rows (where the row is), however few
    it caches: 'big' on 2 ranks, 10M rows each, needs 40 MB of it beside a one-row cache."""
    tier = DiskTier(tmp_path, cache_rows=1)
    with pytest.raises(
        PlanError,
        match=r"^the disk tier's cache of tables \['big'\] takes 38\.1 MiB per rank .* the "
        r"10000000 block rows a rank holds\), more than the memory budget of 28\.6 MiB; give "
        r"DiskTier a smaller cache_bytes= or cache_rows=, use more ranks, or raise the budget$",
    ):
        plan_tables(TABLES[1:], 2, memory_budget_bytes=30 * MB, disk_tier=tier, price=price)
    plan = plan_tables(TABLES[1:], 2, memory_budget_bytes=50 * MB, disk_tier=tier, price=price)
    assert plan.tables["big"] == row_wise(on_disk=True)


def test_cache_rows_and_cache_bytes_price_the_same_cache(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """cache_bytes= keeps a 1/17 of itself for the evicted rows on their way to the file (up
    to a 1/16 of the slots, BackgroundWrites); the same cache sized by cache_rows= counts them
    too, so both price the same memory: 32 slots of 10 bytes, 2 rows in flight."""
    blocks = {"t": (1000, 10)}
    by_bytes = DiskTier(tmp_path, cache_bytes=(32 + 2) * 10)
    by_rows = DiskTier(tmp_path, cache_rows=32)
    assert by_bytes.slots(blocks) == by_rows.slots(blocks) == {"t": 32}
    assert by_rows.cache_memory(blocks) == by_bytes.cache_memory(blocks)


def test_disk_tables_sharing_a_rank_count_its_cache_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two disk tables on one rank share its cache_bytes= (split by their bytes): the search
    counts it once, as the disk rule does, so the small table still fits beside them."""
    from manualpar.embeddings.planning import Workload, load_topology, plan_by_cost, rule_costs

    # with row-wise Adagrad: 17 floats a row, 68 MB and 136 MB; 0.7 MB
    tables = [
        EmbeddingBagConfig("a", 1_000_000, 16),
        EmbeddingBagConfig("b", 2_000_000, 16),
        EmbeddingBagConfig("c", 10_000, 16),
    ]
    tier = DiskTier(tmp_path, cache_bytes=16 * 2**20)
    cache = tier.cache_memory({"a": (1_000_000, 68), "b": (2_000_000, 68)})  # 37.6 MB
    budget = cache + 2 * MB  # the cache once and "c", not the cache twice (54 MB)
    plan = plan_tables(tables, 1, memory_budget_bytes=budget, disk_tier=tier, price="time")
    assert plan.tables["a"].on_disk and plan.tables["b"].on_disk and not plan.tables["c"].on_disk
    state, full_rows = rule_costs(None)
    planned = plan_by_cost(
        {t.name: t for t in tables},
        load_topology("cpu-host", 1),
        Workload(64, state=state, full_rows=full_rows),
        memory_budget_bytes=budget,
        disk_tier=tier,
        pinned={"a": row_wise(on_disk=True), "b": row_wise(on_disk=True)},
    )
    assert planned.costs.memory.tolist() == pytest.approx([cache + 10_000 * 68], rel=1e-12)
