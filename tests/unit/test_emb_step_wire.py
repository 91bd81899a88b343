"""Half-precision exchanges, on one process: the byte model and the cost model price the wire
dtype (pooled rows and gradients halved in 16 bits, quartered in 8, plus one flag per pair of
ranks for float16 and float8 pooled rows; ids and sizes unchanged), and shard_embeddings
refuses a wire dtype an exchange cannot carry, saying what to use (the exchanges themselves:
tests/dist/test_emb_step_wire_dtype_ranks.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_tables import raises, tiny_tables

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    WireDtypes,
    column_wise,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.planning import Workload
from manualpar.embeddings.planning.cost_model import plan_costs
from manualpar.embeddings.planning.exchange_bytes import (
    expected_exchange_bytes,
    expected_sent_bytes,
)
from manualpar.embeddings.planning.topology import load_topology
from manualpar.errors import BuilderError

CONFIGS = [
    EmbeddingBagConfig("user", 60, 8),
    EmbeddingBagConfig("item", 40, 6, feature_names=("item", "last_item")),
    EmbeddingBagConfig("wide", 30, 12),
]
PER_BAG = {"user": 2.0, "item": 1.5, "last_item": 1.5, "wide": 3.0}
WORLD = 3
PLAN = EmbeddingPlan(
    WORLD, {"user": row_wise(), "item": table_wise(2), "wide": column_wise([0, 1, 2])}
)


def _matrix(wire: WireDtypes | None = None) -> dict[str, list[list[float]]]:
    extra = {} if wire is None else {"wire": wire}
    return expected_exchange_bytes(CONFIGS, PLAN, 16, PER_BAG, **extra).bytes


@pytest.mark.parametrize(
    ("wire", "pooled", "gradients", "flag"),
    [
        (WireDtypes(torch.bfloat16, torch.bfloat16), 0.5, 0.5, 0),
        (WireDtypes(torch.float16, torch.bfloat16), 0.5, 0.5, 2),
        (WireDtypes(torch.float8_e4m3fn, torch.float32), 0.25, 1.0, 1),
    ],
)
def test_the_byte_model_prices_the_wire_dtype(
    wire: WireDtypes, pooled: float, gradients: float, flag: int
) -> None:
    plain, half = _matrix(), _matrix(wire)
    assert half["ids"] == plain["ids"] and half["sizes"] == plain["sizes"]
    for s in range(WORLD):
        for r in range(WORLD):
            off = int(s != r)
            assert half["pooled"][s][r] == plain["pooled"][s][r] * pooled + flag * off
            assert half["gradients"][s][r] == plain["gradients"][s][r] * gradients
    sent = expected_sent_bytes(CONFIGS, PLAN, 16, PER_BAG, wire=wire)
    model = expected_exchange_bytes(CONFIGS, PLAN, 16, PER_BAG, wire=wire)
    assert sent == pytest.approx([model.sent(rank) for rank in range(WORLD)])


def test_the_cost_model_prices_the_wire_dtype() -> None:
    topology = load_topology("cpu-host", WORLD, WORLD)
    wire = WireDtypes(torch.bfloat16, torch.bfloat16)
    f32 = plan_costs(CONFIGS, PLAN, topology, Workload(16, PER_BAG))
    bf16 = plan_costs(CONFIGS, PLAN, topology, Workload(16, PER_BAG, wire=wire))
    model = expected_exchange_bytes(CONFIGS, PLAN, 16, PER_BAG, wire=wire)
    for rank in range(WORLD):
        assert bf16.sent[rank].item() == pytest.approx(model.sent(rank))
        assert bf16.sent[rank].item() < f32.sent[rank].item()


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (torch.float16, ("output gradients cannot travel in torch.float16", "backward=torch.bf")),
        (
            WireDtypes(torch.bfloat16, torch.float8_e5m2),
            ("output gradients cannot travel in torch.float8_e5m2", "torch.bfloat16"),
        ),
        (WireDtypes(torch.int8), ("pooled outputs cannot travel in torch.int8", "float8_e4m3fn")),
        ("b16", ("wire_dtype='b16' is not a wire dtype name; use one of ['bf16', 'fp16'",)),
        (16, ("wire_dtype takes a torch dtype, WireDtypes(forward=, backward=) or", "got int")),
    ],
)
def test_shard_embeddings_refuses_a_wire_dtype_an_exchange_cannot_carry(
    wire: object, message: tuple[str, ...]
) -> None:
    strategy = mp.ManualParallelStrategy()
    with raises(BuilderError, *message):
        shard_embeddings(
            EmbeddingBagCollection(tiny_tables(), seed=0),
            strategy,
            {"user": table_wise(0), "item": table_wise(0)},
            SGD(lr=0.1),
            wire_dtype=wire,  # type: ignore[arg-type]
        )


def test_a_short_name_is_the_wire_it_names() -> None:
    """`wire_dtype="fp16"` (what a command line passes) is float16 out, bfloat16 back."""
    emb = shard_embeddings(
        EmbeddingBagCollection(tiny_tables(), seed=0),
        mp.ManualParallelStrategy(),
        {"user": table_wise(0), "item": table_wise(0)},
        SGD(lr=0.1),
        wire_dtype="fp16",
    )
    assert emb.step.wire == WireDtypes(torch.float16, torch.bfloat16)
