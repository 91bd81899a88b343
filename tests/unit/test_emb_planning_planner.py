"""The planner and the byte count, called directly (the plan command only prints their results)."""

from __future__ import annotations

import pytest

from manualpar.embeddings import SGD, Adam, EmbeddingBagConfig, RowWiseAdagrad, table_row_wise
from manualpar.embeddings.config import block_bytes
from manualpar.embeddings.plan import TablePlacement
from manualpar.embeddings.planning.planner import plan_tables, plan_uniform, table_bytes
from manualpar.errors import PlanError

MiB = 2**20


def _tables(*specs: tuple[str, int, int]) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name, rows, dim) for name, rows, dim in specs]


def test_block_bytes_counts_weights_and_each_kind_of_state() -> None:
    assert block_bytes(10, 8, state={}) == 10 * 8 * 4
    assert block_bytes(10, 8) == 10 * (8 + 1) * 4  # row-wise Adagrad: one float per row
    assert block_bytes(10, 8, Adam(lr=0.1).STATE) == 10 * 8 * 3 * 4  # two moments per element
    config = EmbeddingBagConfig("t", 1000, 16)
    assert config.num_bytes == 1000 * 16 * 4
    assert table_bytes(config, SGD(lr=0.1)) == config.num_bytes
    assert table_bytes(config) == table_bytes(config, RowWiseAdagrad(lr=0.1)) == 1000 * 17 * 4


def test_plan_bytes_per_rank_sums_the_blocks_each_rank_holds() -> None:
    tables = _tables(("big", 1001, 8), ("small", 10, 4))
    plan = plan_uniform("row_wise", tables, 2)
    # rows split 501 / 500; the small table's 10 rows 5 / 5
    assert plan.bytes_per_rank(tables) == [
        block_bytes(501, 8) + block_bytes(5, 4),
        block_bytes(500, 8) + block_bytes(5, 4),
    ]
    adam = Adam(lr=0.1).STATE
    assert plan.bytes_per_rank(tables, adam)[0] == block_bytes(501, 8, adam) + block_bytes(
        5, 4, adam
    )


def test_memory_method_replicates_small_tables_and_splits_one_larger_than_an_even_share() -> None:
    tables = _tables(("huge", 200_000, 64), ("mid_a", 40_000, 64), ("mid_b", 30_000, 64))
    tables.append(EmbeddingBagConfig("tiny", 100, 8))
    plan = plan_tables(tables, 2, price="memory")
    assert plan.tables["tiny"] == TablePlacement("data_parallel")
    assert plan.tables["huge"] == TablePlacement("row_wise")
    # the two mid tables go whole to the least-loaded ranks: one each
    ranks = {plan.tables["mid_a"].ranks, plan.tables["mid_b"].ranks}
    assert ranks == {(0,), (1,)}
    assert "larger than an even share" in plan.notes["huge"]
    plan.validate(tables, 2)


def test_memory_method_keeps_a_large_table_on_one_node_when_it_fits_there() -> None:
    tables = _tables(("huge", 400_000, 64), ("a", 20_000, 64), ("b", 20_000, 64))
    plan = plan_tables(tables, 4, ranks_per_node=2, price="memory")
    assert plan.tables["huge"].sharding == "table_row_wise"
    assert plan.tables["huge"].ranks in {(0, 1), (2, 3)}
    assert plan.notes["huge"].startswith("rows split over node")


def test_auto_honours_the_memory_budget_and_says_how_much_is_needed() -> None:
    tables = _tables(("a", 100_000, 64), ("b", 100_000, 64))
    need = -(-2 * table_bytes(tables[0]) // 2)
    with pytest.raises(PlanError, match=r"at least 24\.\d MiB per rank on 2 ranks"):
        plan_tables(tables, 2, memory_budget_bytes=need - 1)
    plan = plan_tables(tables, 2, memory_budget_bytes=need + MiB)
    assert max(plan.bytes_per_rank(tables)) <= need + MiB


def test_uniform_table_wise_puts_the_largest_tables_first_on_the_least_loaded_rank() -> None:
    tables = _tables(("a", 9_000, 16), ("b", 5_000, 16), ("c", 4_000, 16), ("d", 1_000, 16))
    plan = plan_uniform("table_wise", tables, 2)
    ranks = {name: placement.ranks[0] for name, placement in plan.tables.items()}
    # 9000 rows on rank 0; 5000 + 4000 on rank 1; then a tie, which the lower rank takes
    assert ranks == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert list(plan.tables) == ["a", "b", "c", "d"]  # in the tables' order


def test_uniform_plan_over_the_budget_names_the_rank() -> None:
    tables = _tables(("a", 100_000, 64), ("b", 10, 4))
    size = table_bytes(tables[0])
    with pytest.raises(PlanError, match=r"plan table_wise puts 24\.\d MiB on rank 0, more than"):
        plan_uniform("table_wise", tables, 2, memory_budget_bytes=size - 1)
    with pytest.raises(PlanError, match=r"sharding must be one of .*got 'diagonal'"):
        plan_uniform("diagonal", tables, 2)


def test_table_row_wise_defaults_to_the_launchers_processes_per_node(monkeypatch):
    for key, value in {
        "RANK": "2",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(key, value)
    assert table_row_wise(1).ranks == (2, 3)
    assert table_row_wise(1, 3).ranks == (3, 4, 5)


def test_constraints_and_options_objects_plan_as_the_keywords_do() -> None:
    from manualpar.embeddings.planning import PlanConstraints, PlanOptions
    from manualpar.errors import ConfigTypeError

    tables = _tables(("huge", 200_000, 64), ("mid", 40_000, 64), ("tiny", 100, 8))
    budget = 40 * MiB
    by_keywords = plan_tables(tables, 4, memory_budget_bytes=budget, ranks_per_node=2, skew=1.05)
    by_objects = plan_tables(
        tables,
        4,
        PlanConstraints(memory_budget_bytes=budget),
        PlanOptions(ranks_per_node=2, skew=1.05),
    )
    assert by_objects.tables == by_keywords.tables and by_objects.notes == by_keywords.notes
    with pytest.raises(ConfigTypeError, match=r"memory_budget_bytes= was given twice"):
        plan_tables(tables, 4, PlanConstraints(memory_budget_bytes=budget), memory_budget_bytes=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'budget'"):
        plan_tables(tables, 4, budget=budget)  # type: ignore[call-arg]
    with pytest.raises(PlanError, match=r"price must be one of \('time', 'memory'\)"):
        plan_tables(tables, 4, price="fastest")


def test_method_is_the_old_spelling_of_price_and_warns() -> None:
    tables = _tables(("huge", 200_000, 64), ("mid_a", 40_000, 64), ("tiny", 100, 8))
    with pytest.warns(FutureWarning, match=r"plan_tables\(method=\.\.\.\) was renamed"):
        old = plan_tables(tables, 2, method="memory")
    assert old.tables == plan_tables(tables, 2, price="memory").tables
    with pytest.warns(FutureWarning, match=r'method="cost" is price="time"'):
        assert plan_tables(tables, 2, method="cost").tables == plan_tables(tables, 2).tables
    with pytest.raises(PlanError, match=r"plan method must be one of \('cost', 'memory'\)"):
        plan_tables(tables, 2, method="fastest")


def test_allowed_dtypes_are_a_constraint_of_the_cost_search() -> None:
    import torch

    from manualpar.embeddings.planning import (
        PlanConstraints,
        load_topology,
        plan_by_cost,
        rule_costs,
    )
    from manualpar.embeddings.planning import Workload as PlanWorkload

    tables = {t.name: t for t in _tables(("a", 400_000, 64), ("b", 100_000, 64))}
    state, full_rows = rule_costs(None)
    workload = PlanWorkload(256, state=state, full_rows=full_rows)
    topology = load_topology("cpu-host", 2)
    budget = table_bytes(tables["a"]) * 3 // 4  # a whole table fits no rank in float32
    dtypes = (torch.float32, torch.bfloat16)
    limits = PlanConstraints(memory_budget_bytes=budget, dtypes=dtypes)
    planned = plan_by_cost(tables, topology, workload, constraints=limits)
    keywords = plan_by_cost(
        tables, topology, workload, memory_budget_bytes=budget, precisions=list(dtypes)
    )
    assert planned.plan.tables == keywords.plan.tables and planned.dtypes == keywords.dtypes
    with pytest.raises(PlanError, match=r"plan_tables\(\): dtypes= changes how tables store"):
        plan_tables(list(tables.values()), 2, dtypes=dtypes)
