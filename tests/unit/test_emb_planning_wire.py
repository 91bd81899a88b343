"""The planner chooses the exchanges' wire dtypes when allowed (PlanConstraints.wire_dtypes):
each collection takes the allowed one its predicted step is fastest with, the more precise on a
tie; the plan records it (EmbeddingPlan.wire, wire_note, JSON) and shard_embeddings uses it.
Without wire_dtypes the plans are those of float32, recording nothing (the byte and cost
models' prices of a wire: test_emb_step_wire.py, and against the real splits
tests/dist/test_emb_planning_cost_model_ranks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_tables import raises, tiny_tables

import manualpar as mp
from manualpar.cli import main
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    WireDtypes,
    data_parallel,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.planning import (
    PlanConstraints,
    Workload,
    load_topology,
    plan_collections,
    plan_costs,
    plan_tables,
)
from manualpar.errors import PlanError

BF16 = WireDtypes(torch.bfloat16, torch.bfloat16)
FP32 = WireDtypes()
# four tables of 12 MiB on 2 nodes of 2 ranks, 2,048 samples a rank: every placement sends
# each rank's pooled rows across the nodes' links, the step's largest cost
TABLES = [EmbeddingBagConfig(f"t{i}", 50_000, 64) for i in range(4)]
TOPOLOGY = load_topology("cpu-host", 4, 2)
PRICED = {"topology": TOPOLOGY, "batch_per_rank": 2048, "replicate_bytes": 0}


def _slowest(plan: EmbeddingPlan, wire: WireDtypes) -> float:
    """The predicted slowest rank of `plan`'s placements with its exchanges in `wire`."""
    placements = EmbeddingPlan(plan.world_size, plan.tables)
    costs = plan_costs(TABLES, placements, TOPOLOGY, Workload(2048, wire=wire))
    return float(costs.seconds(TOPOLOGY).max())


def test_the_planner_takes_bf16_when_allowed_and_the_exchange_dominates() -> None:
    plan = plan_tables(TABLES, 4, wire_dtypes=("fp32", "bf16"), **PRICED)  # type: ignore[arg-type]
    assert plan.wire == BF16
    fp32, bf16 = _slowest(plan, FP32), _slowest(plan, BF16)
    assert bf16 < 0.9 * fp32  # the halved exchange is worth over 10% of the step here
    assert plan.wire_note.startswith("planned from fp32, bf16: slowest rank ")
    assert "ms with fp32" in plan.wire_note and "ms with bf16" in plan.wire_note
    assert "exchanges in bf16 (planned from fp32, bf16" in plan.describe(TABLES)
    # priced as it runs: the plan's own wire, whatever the workload says
    costs = plan_costs(TABLES, plan, TOPOLOGY, Workload(2048))
    assert float(costs.seconds(TOPOLOGY).max()) == bf16
    back = EmbeddingPlan.from_json(plan.to_json())
    assert back == plan and back.wire == BF16


def test_float32_stays_unless_a_narrower_wire_is_allowed() -> None:
    default = plan_tables(TABLES, 4, **PRICED)  # type: ignore[arg-type]
    assert default.wire is None and default.wire_note == ""
    assert "wire" not in default.to_dict() and "exchanges in" not in default.describe(TABLES)
    only = plan_tables(TABLES, 4, wire_dtypes=("fp32",), **PRICED)  # type: ignore[arg-type]
    assert only.wire == FP32 and only.wire_note == "planned: the only wire dtype allowed"
    assert only.tables == default.tables and only.notes == default.notes
    forced = plan_tables(TABLES, 4, PlanConstraints(wire_dtypes=(BF16,)), **PRICED)  # type: ignore[arg-type]
    assert forced.wire == BF16


def test_each_collection_takes_its_own_wire_and_float32_on_a_tie() -> None:
    """A collection of replicated tables exchanges nothing: every wire prices alike, and it
    keeps the first allowed; bf16 beats fp16 by fp16's overflow flags."""
    small = [EmbeddingBagConfig("s0", 100, 8), EmbeddingBagConfig("s1", 100, 8)]
    plans = plan_collections(
        {"big": TABLES, "small": small},
        4,
        topology=TOPOLOGY,
        batch_per_rank=2048,
        wire_dtypes=("fp32", "fp16", "bf16"),
        pinned={"small.s0": data_parallel(), "small.s1": data_parallel()},
    )
    assert plans["big"].wire == BF16 and plans["small"].wire == FP32
    assert "planned from fp32, fp16, bf16" in plans["small"].wire_note


def test_shard_embeddings_takes_the_planned_wire_unless_told() -> None:
    strategy = mp.ManualParallelStrategy()
    plan = EmbeddingPlan(1, {"user": table_wise(0), "item": table_wise(0)}, wire=BF16)

    def sharded(**wire: object) -> WireDtypes:
        ebc = EmbeddingBagCollection(tiny_tables(), seed=0)
        return shard_embeddings(ebc, strategy, plan, SGD(lr=0.1), **wire).step.wire  # type: ignore[arg-type]

    assert sharded() == BF16
    assert sharded(wire_dtype="fp32") == FP32


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"wire_dtypes": ("fp32", "b16")}, ("wire_dtypes: 'b16' is not a wire dtype", "'bf16'")),
        (
            {"wire_dtypes": (torch.float16,)},
            ("torch.float16 is not a wire dtype", "backward one of", "torch.bfloat16"),
        ),
        (
            {"wire_dtypes": ("fp32", "bf16"), "price": "memory"},
            ("wire_dtypes= needs price='time'", "shard_embeddings(..., wire_dtype=...)"),
        ),
    ],
)
def test_a_wire_dtype_the_exchanges_cannot_carry_is_refused(
    keywords: dict[str, object], message: tuple[str, ...]
) -> None:
    with raises(PlanError, *message):
        plan_tables(TABLES, 4, **keywords)  # type: ignore[arg-type]


def test_a_plan_file_with_a_bad_wire_is_refused() -> None:
    text = EmbeddingPlan(1, {"user": table_wise(0)}, wire=BF16).to_json()
    with raises(PlanError, "a plan's wire: unknown torch dtype names", "bfloat17"):
        EmbeddingPlan.from_json(text.replace('"backward": "bfloat16"', '"backward": "bfloat17"'))


def test_the_plan_command_chooses_among_the_wire_dtypes_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "plan.json"
    tables = [arg for i in range(4) for arg in ("--table", f"t{i}:50000:64")]
    command = ["plan", *tables, "--world-size", "4", "--ranks-per-node", "2"]
    command += ["--batch-per-rank", "2048", "--json", str(out), "--wire-dtypes", "fp32,bf16"]
    assert main(command) == 0
    assert "exchanges in bf16 (planned from fp32, bf16: slowest rank" in capsys.readouterr().out
    assert EmbeddingPlan.from_json(out.read_text()).wire == BF16
    assert main([*command, "--plan", "memory"]) == 2
    assert "--wire-dtypes: only --plan auto prices the exchanges' dtypes" in capsys.readouterr().err
