"""plan_collections: plan="auto" for several collections at once, balanced over all their tables."""

from __future__ import annotations

import re

import pytest

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    Adam,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    TablePlacement,
)
from manualpar.embeddings.planning import plan_collections
from manualpar.embeddings.planning.planner import plan_tables, table_bytes
from manualpar.errors import PlanError

MiB = 2**20


def _tables(prefix: str, *rows: int, dim: int = 16) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(f"{prefix}{i}", n, dim) for i, n in enumerate(rows)]


def _two_towers() -> dict[str, EmbeddingBagCollection]:
    """Two collections of three equal tables each (6.5 MiB with row-wise Adagrad's state)."""
    with mp.empty_init():
        return {
            "user": EmbeddingBagCollection(_tables("user_", 100_000, 100_000, 100_000)),
            "item": EmbeddingBagCollection(_tables("item_", 100_000, 100_000, 100_000)),
        }


def _tables_per_rank(plans: dict, world: int) -> list[int]:
    ranks = [p.ranks[0] for plan in plans.values() for p in plan.tables.values()]
    return [ranks.count(r) for r in range(world)]


def _bytes_per_rank(plans: dict, towers: dict) -> list[int]:
    per_tower = [plans[name].bytes_per_rank(towers[name].configs) for name in towers]
    return [sum(column) for column in zip(*per_tower, strict=True)]


def test_two_towers_share_the_ranks_evenly_where_separate_plans_do_not() -> None:
    towers = _two_towers()
    table = table_bytes(towers["user"].configs[0])
    separate = {name: plan_tables(ebc.configs, 2, price="memory") for name, ebc in towers.items()}
    assert _tables_per_rank(separate, 2) == [4, 2]  # each tower starts from empty ranks
    assert _bytes_per_rank(separate, towers) == [4 * table, 2 * table]

    plans = plan_collections(towers, 2, price="memory")
    assert list(plans) == ["user", "item"]
    assert _tables_per_rank(plans, 2) == [3, 3]
    per_rank = _bytes_per_rank(plans, towers)
    assert per_rank == [3 * table, 3 * table]
    assert max(per_rank) - min(per_rank) <= table
    for name, ebc in towers.items():
        plans[name].validate(ebc.configs, 2)
        assert list(plans[name].tables) == [c.name for c in ebc.configs]
        assert all(note.startswith("whole on rank") for note in plans[name].notes.values())


def test_odd_counts_and_sizes_stay_within_one_table_per_rank() -> None:
    with mp.empty_init():
        towers = {
            "a": EmbeddingBagCollection(_tables("a", 90_000, 70_000, 50_000, 30_000)),
            "b": EmbeddingBagCollection(_tables("b", 80_000, 60_000, 40_000)),
            "c": EmbeddingBagCollection(_tables("c", 20_000, 10_000)),
        }
    plans = plan_collections(towers, 3)
    per_rank = _bytes_per_rank(plans, towers)
    largest = max(table_bytes(c) for ebc in towers.values() for c in ebc.configs)
    assert max(per_rank) - min(per_rank) <= largest
    assert sum(per_rank) == sum(table_bytes(c) for ebc in towers.values() for c in ebc.configs)


def test_big_tables_are_split_by_rows_and_tiny_ones_replicated_across_collections() -> None:
    user = [*_tables("user_", 400_000, 40_000), EmbeddingBagConfig("user_tiny", 100, 8)]
    item = _tables("item_", 40_000, 30_000)
    plans = plan_collections({"user": user, "item": item}, 2, price="memory")
    assert plans["user"].tables["user_0"] == TablePlacement("row_wise")
    assert "larger than an even share" in plans["user"].notes["user_0"]
    assert plans["user"].tables["user_tiny"] == TablePlacement("data_parallel")
    whole = [plans["user"].tables["user_1"], *plans["item"].tables.values()]
    assert all(p.sharding == "table_wise" for p in whole)


def test_one_collection_gets_the_plan_plan_tables_makes() -> None:
    tables = [
        *_tables("t", 200_000, 40_000, 30_000, 20_000, 20_000),
        EmbeddingBagConfig("tiny", 100, 8),
        EmbeddingBagConfig("two", 30_000, 32, feature_names=("two_a", "two_b")),
    ]
    pooling = {"t1": 20.0, "two": 3.0}
    options = {"ranks_per_node": 2, "rule": Adam(lr=0.1), "replicate_bytes": 64 * 2**10}
    expected = plan_tables(tables, 4, pooling_factors=pooling, **options)  # type: ignore[arg-type]
    got = plan_collections({"only": tables}, 4, pooling_factors={"only": pooling}, **options)
    assert got == {"only": expected}
    assert got["only"].notes == expected.notes  # table names as they are: no collection prefix
    budget = max(expected.bytes_per_rank(tables, Adam.STATE)) + MiB
    assert plan_collections({"x": tables}, 4, memory_budget_bytes=budget)["x"] == plan_tables(
        tables, 4, memory_budget_bytes=budget
    )
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables)
    strategy = mp.ManualParallelStrategy()  # one process
    whole = sum(table_bytes(c) for c in tables)
    assert plan_collections({"x": ebc}, strategy)["x"] == plan_tables(tables, 1)
    with pytest.raises(PlanError, match=r"^the 7 tables \(largest 't0': 13\.0 MiB\) hold 23\.9"):
        plan_collections({"x": ebc}, strategy, memory_budget_bytes=whole - 1)


def test_each_collection_may_have_its_own_optimizer() -> None:
    user, item = _tables("u", 10_000), _tables("i", 10_000)
    plans = plan_collections(
        {"user": user, "item": item},
        2,
        rule={"user": SGD(lr=0.1), "item": Adam(lr=0.1)},
        price="memory",
    )
    # Adam's two moments triple the item table: more than an even share of the two, so split
    assert plans["item"].notes["i0"] == (
        "rows split over all 2 ranks (larger than an even share; 937.5 KiB each)"
    )
    assert plans["user"].notes["u0"] == "whole on rank 0 (625.0 KiB; least-loaded rank)"
    shared = plan_collections(
        {"user": user, "item": item}, 2, rule=RowWiseAdagrad(lr=0.1), price="memory"
    )
    assert shared["user"].notes["u0"] == "whole on rank 0 (664.1 KiB; least-loaded rank)"
    assert shared["item"].notes["i0"] == "whole on rank 1 (664.1 KiB; least-loaded rank)"


def test_over_the_budget_names_the_tables_with_their_collection() -> None:
    towers = _two_towers()
    table = table_bytes(towers["user"].configs[0])
    message = (
        "the 6 tables (largest 'user.user_0': 6.5 MiB) hold 38.9 MiB with optimizer state: at "
        "least 19.5 MiB per rank on 2 ranks, more than the budget of 19.5 MiB; raise the memory "
        "budget to 19.5 MiB or more, use 3 or more ranks, or shrink the tables"
    )
    with pytest.raises(PlanError, match=f"^{re.escape(message)}$"):
        plan_collections(towers, 2, memory_budget_bytes=3 * table - 1)
    assert _tables_per_rank(plan_collections(towers, 2, memory_budget_bytes=3 * table), 2) == [3, 3]


def test_a_table_no_split_can_fit_is_named_with_its_collection() -> None:
    # 12k rows go to rank 0, 9k to rank 1; the other 9k fit neither rank whole, nor split
    first, second = _tables("a", 12_000, 9_000), _tables("b", 9_000)
    budget = (table_bytes(first[0]) + 2 * table_bytes(first[1])) // 2
    with pytest.raises(
        PlanError,
        match=r"^table 'b\.b0' needs 298\.8 KiB per rank split over 2 ranks, but ranks already "
        r"hold \['796\.9 KiB', '597\.7 KiB'\] of a 996\.1 KiB budget",
    ):
        plan_collections({"a": first, "b": second}, 2, memory_budget_bytes=budget, price="memory")


def test_measured_budget_says_where_it_came_from() -> None:
    from manualpar.embeddings.kernels.row_memory import available_bytes

    strategy = mp.ManualParallelStrategy()
    free = available_bytes(strategy.device)
    assert free is not None
    rows = free // (65 * 4) * 4  # four times the free memory, with row-wise state
    with mp.empty_init():
        towers = {
            "user": EmbeddingBagCollection([EmbeddingBagConfig("huge", rows, 64)]),
            "item": EmbeddingBagCollection(_tables("item_", 1000)),
        }
    with pytest.raises(PlanError) as caught:
        plan_collections(towers, strategy)
    message = str(caught.value)
    assert message.startswith("the 2 tables (largest 'user.huge': ")
    assert "(the budget is the memory each rank can allocate now, " in message
    assert message.endswith("; pass memory_budget_bytes= to plan for another amount)")


@pytest.mark.parametrize(
    ("collections", "world", "options", "message"),
    [
        (
            [_tables("a", 10)],
            2,
            {},
            "plan_collections() takes a non-empty mapping name -> EmbeddingBagCollection, e.g. "
            "{'user': model.user_tables, 'item': model.item_tables}; got list",
        ),
        (
            {},
            2,
            {},
            "plan_collections() takes a non-empty mapping name -> EmbeddingBagCollection, e.g. "
            "{'user': model.user_tables, 'item': model.item_tables}; got {}",
        ),
        (
            {"user": "user_id"},
            2,
            {},
            "plan_collections(): collection 'user' is a str; pass the EmbeddingBagCollection "
            "or EmbeddingCollection (before shard_embeddings) or its list of EmbeddingBagConfig",
        ),
        (
            {"user": _tables("a", 10) + _tables("a", 10)},
            2,
            {},
            "table names must be unique; repeated: ['a0']",
        ),
        (
            {"user": _tables("a", 10)},
            "2",
            {},
            "plan_collections(): world must be the world size (an int) or the strategy, got str",
        ),
        (
            {"user": _tables("a", 10)},
            0,
            {},
            "plan_collections(): the world size must be >= 1, got 0",
        ),
        (
            {"user": _tables("a", 10)},
            2,
            {"rule": {"usr": SGD(lr=0.1)}},
            "plan_collections(): rule names collections ['usr'] that were not given; the "
            "collections are ['user']",
        ),
        (
            {"user": _tables("a", 10)},
            2,
            {"pooling_factors": [2.0]},
            "plan_collections(): pooling_factors must be a mapping collection name -> value, "
            "got list",
        ),
    ],
)
def test_bad_arguments_are_named(collections: object, world: object, options: dict, message: str):
    with pytest.raises((PlanError, mp.EmbeddingInputError), match=f"^{re.escape(message)}$"):
        plan_collections(collections, world, **options)  # type: ignore[arg-type]
