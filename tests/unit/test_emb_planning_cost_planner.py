"""plan="auto" minimises the predicted slowest rank: by the cost model, its plan is at least as
fast as every uniform plan and the earlier memory-only placement, on one node and across nodes;
it keeps the memory budget, says why it chose and what came second, and plans 1,024 ranks."""

from __future__ import annotations

import random

import pytest
import torch

from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    column_wise,
    table_wise,
)
from manualpar.embeddings.planning import (
    Workload,
    load_topology,
    plan_by_cost,
    plan_costs,
    plan_tables,
    plan_uniform,
    price_cache,
    rule_costs,
)
from manualpar.embeddings.planning.candidates import least_busy
from manualpar.errors import PlanError

MiB = 2**20


def _tables(count: int, seed: int) -> list[EmbeddingBagConfig]:
    rng = random.Random(seed)
    return [
        EmbeddingBagConfig(f"t{i}", int(10 ** rng.uniform(2, 6.5)), rng.choice([16, 32, 64, 128]))
        for i in range(count)
    ]


def _slowest(tables, plan, topology, workload) -> float:  # type: ignore[no-untyped-def]
    return float(plan_costs(tables, plan, topology, workload).seconds(topology).max())


@pytest.mark.parametrize(
    ("preset", "world", "per_node", "count", "per_bag"),
    [
        ("cpu-host", 2, 2, 6, 1.0),
        ("cpu-host", 4, 4, 12, 8.0),
        ("a100-nvlink-hdr", 16, 8, 24, 4.0),
        ("h100-nvlink-ndr", 64, 8, 40, 2.0),
    ],
)
def test_the_pick_is_no_slower_than_any_uniform_plan_or_the_memory_placement(
    preset: str, world: int, per_node: int, count: int, per_bag: float
) -> None:
    tables = _tables(count, seed=world)
    topology = load_topology(preset, world, per_node)
    state, full_rows = rule_costs(RowWiseAdagrad(lr=0.1))
    pooling = {t.name: per_bag for t in tables}
    workload = Workload(256, pooling, state=state, full_rows=full_rows)
    options = {"ranks_per_node": per_node}
    auto = plan_tables(
        tables, world, topology=topology, batch_per_rank=256, pooling_factors=pooling, **options
    )  # type: ignore[arg-type]
    ours = _slowest(tables, auto, topology, workload)
    others = {
        "memory": plan_tables(tables, world, price="memory", pooling_factors=pooling, **options),  # type: ignore[arg-type]
        **{
            kind: plan_uniform(kind, tables, world, **options)
            for kind in ("table_wise", "row_wise", "table_row_wise")
        },  # type: ignore[arg-type]
    }
    for name, plan in others.items():
        assert ours <= _slowest(tables, plan, topology, workload) * (1 + 1e-9), name


def test_the_budget_holds_and_a_table_that_fits_nowhere_is_named() -> None:
    tables = [
        EmbeddingBagConfig("big", 400_000, 64),
        *(EmbeddingBagConfig(f"mid{i}", 50_000, 32) for i in range(6)),
    ]
    topology = load_topology("cpu-host", 4, 4)
    workload = Workload(128)
    roomy = plan_by_cost({t.name: t for t in tables}, topology, workload)
    fullest = float(roomy.costs.memory.max())
    tight = int(fullest * 0.6)
    planned = plan_by_cost(
        {t.name: t for t in tables}, topology, workload, memory_budget_bytes=tight
    )
    assert float(planned.costs.memory.max()) <= tight
    assert planned.costs.memory.tolist() == planned.plan.bytes_per_rank(tables)
    with pytest.raises(
        PlanError,
        match=r"^table 'big' \(99\.2 MiB with optimizer state\) fits no rank: split over all 4 "
        r"ranks it needs 24\.8 MiB each, but ranks already hold 0 bytes each of a 1\.0 MiB "
        r"budget\. Raise the memory budget, add ranks, or shrink the tables, or give a DiskTier",
    ):
        plan_by_cost({t.name: t for t in tables}, topology, workload, memory_budget_bytes=MiB)


def test_tables_over_the_budget_go_on_disk_with_a_note() -> None:
    tables = [EmbeddingBagConfig("huge", 1_000_000, 64), EmbeddingBagConfig("small", 50_000, 64)]
    topology = load_topology("cpu-host", 2, 2)
    tier = DiskTier("unused", cache_bytes=16 * MiB)
    planned = plan_by_cost(
        {t.name: t for t in tables},
        topology,
        Workload(256),
        memory_budget_bytes=60 * MiB,
        disk_tier=tier,
    )
    assert planned.plan.tables["huge"].on_disk and not planned.plan.tables["small"].on_disk
    assert planned.plan.notes["huge"].startswith(
        "on disk: in memory it would exceed the 60.0 MiB budget per rank;"
    )
    assert float(planned.costs.disk.sum()) > 0 and float(planned.costs.disk_rows.sum()) > 0


def test_every_note_says_what_the_table_costs_and_why_the_runner_up_lost() -> None:
    tables = _tables(8, seed=3)
    planned = plan_by_cost(
        {t.name: t for t in tables}, load_topology("cpu-host", 4, 2), Workload(256)
    )
    for name, note in planned.plan.notes.items():
        assert note.startswith("slowest rank +"), (name, note)
        assert "sent a rank; runner-up " in note, (name, note)
    assert set(planned.table_seconds) == {t.name for t in tables}


def test_a_thousand_ranks_plan_without_a_job() -> None:
    tables = _tables(40, seed=7)
    topology = load_topology("h100-nvlink-ndr", 1024)
    planned = plan_by_cost({t.name: t for t in tables}, topology, Workload(512))
    planned.plan.validate(tables, 1024)
    slowest = float(planned.seconds.max())
    whole = plan_uniform("table_wise", tables, 1024)
    assert slowest <= _slowest(tables, whole, topology, Workload(512)) * (1 + 1e-9)


def test_costs_recomputed_past_the_cache_give_the_same_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search keeps candidates' costs up to CACHE_BYTES (kept for every candidate, they
    grew with tables x ranks x candidates: over 8 GB for 1,000 tables on 2,000 ranks) and
    recomputes the rest: the same numbers, so the same plan, notes and times."""
    tables = {t.name: t for t in _tables(30, seed=3)}
    topology = load_topology("h100-nvlink-ndr", 64)
    kept = plan_by_cost(tables, topology, Workload(512))
    monkeypatch.setattr(price_cache, "CACHE_BYTES", 0)
    recomputed = plan_by_cost(tables, topology, Workload(512))
    assert recomputed.plan.to_json() == kept.plan.to_json()
    assert torch.equal(recomputed.seconds, kept.seconds)
    assert recomputed.table_seconds == kept.table_seconds


@pytest.mark.parametrize("ranks", [100, 5000])
def test_the_least_busy_ranks_are_a_stable_sorts_first(ranks: int) -> None:
    busy = torch.randint(0, 6, (ranks,), generator=torch.Generator().manual_seed(ranks)) * 0.25
    for count in (1, 4, 8):
        expected = torch.argsort(busy, stable=True)[:count].tolist()
        assert least_busy(busy.double(), count) == expected


def test_asked_precisions_are_lowered_only_where_memory_forces_and_before_disk() -> None:
    tables = {
        "huge": EmbeddingBagConfig("huge", 1_000_000, 64),
        "small": EmbeddingBagConfig("small", 50_000, 64),
    }
    topology = load_topology("cpu-host", 2, 2)
    budget = 100 * MiB  # huge split in two: 124 MiB a rank in fp32, 63 MiB in bf16
    precisions = (torch.float32, torch.bfloat16)
    with pytest.raises(PlanError, match="fits no rank"):
        plan_by_cost(tables, topology, Workload(256), memory_budget_bytes=budget)
    tier = DiskTier("unused", cache_bytes=16 * MiB)
    planned = plan_by_cost(
        tables,
        topology,
        Workload(256),
        memory_budget_bytes=budget,
        disk_tier=tier,
        precisions=precisions,
    )
    assert planned.dtypes == {"huge": torch.bfloat16}
    assert not any(p.on_disk for p in planned.plan.tables.values())
    assert planned.plan.notes["huge"].startswith(
        "in bf16: in fp32 it would exceed the 100.0 MiB budget per rank; "
    )
    assert float(planned.costs.memory.max()) <= budget
    roomy = plan_by_cost(tables, topology, Workload(256), precisions=precisions)
    assert roomy.dtypes == {}  # nothing forces a lower precision


def test_a_hot_table_is_spread_over_nodes() -> None:
    """A whole table's owner serves the global batch: 8 column blocks left their owners 2.7x
    the median rank; rows over every rank (each block returning the bags with an id in its
    rows, the rule needing no whole rows) keep them within 2x."""
    topology = load_topology("h100-nvlink-ndr", 64)  # 8 nodes of 8
    hot = EmbeddingBagConfig("hot", 1_000_000, 128)
    planned = plan_by_cost({"hot": hot}, topology, Workload(4096))
    placement = planned.plan.tables["hot"]
    assert placement.sharding == "row_wise", placement
    predicted = planned.seconds  # the cost model's per-rank step, not a wall-clock time
    assert float(predicted.max()) < 2 * float(predicted.median())
    eight = plan_costs(
        [hot], EmbeddingPlan(64, {"hot": column_wise(range(8))}), topology, Workload(4096)
    )
    assert float(predicted.max()) < 0.7 * float(eight.seconds(topology).max())


def test_hot_tables_under_row_wise_adagrad_are_split_by_rows_over_groups_of_nodes() -> None:
    """Row-wise Adagrad needs whole rows' gradients, so a column block takes the full-width
    gradient of every bag; a row block takes only the bags with an id in its rows (one id a
    bag: a block over 2 nodes of 8 takes a 16th), so on 16 nodes each hot table goes by rows
    over a group of whole nodes and the slowest rank stays within 2x the median, where a hot
    table whole on one rank made it 9x."""
    topology = load_topology("h100-nvlink-ndr", 128)  # 16 nodes of 8
    tables = {f"hot{i}": EmbeddingBagConfig(f"hot{i}", 4_000_000, 128) for i in range(4)}
    tables |= {f"t{i}": EmbeddingBagConfig(f"t{i}", 50_000, 64) for i in range(8)}
    state, full_rows = rule_costs(RowWiseAdagrad(lr=0.1))
    work = Workload(2048, state=state, full_rows=full_rows)
    planned = plan_by_cost(tables, topology, work)
    for name in ("hot0", "hot1", "hot2", "hot3"):
        placement = planned.plan.tables[name]
        assert placement.sharding == "row_wise" and placement.ranks, placement
        nodes = {rank // 8 for rank in placement.ranks}
        assert len(placement.ranks) == 8 * len(nodes) and 1 < len(nodes) < 16  # whole nodes
    predicted = planned.seconds  # the cost model's per-rank step, not a wall-clock time
    assert float(predicted.max()) < 2 * float(predicted.median())
    whole = EmbeddingPlan(128, {**planned.plan.tables, "hot0": table_wise(0)})
    configs = list(tables.values())
    assert float(predicted.max()) < 0.2 * _slowest(configs, whole, topology, work)
