"""Half-precision exchanges stay within their bound of the float32 exchange, and halve its bytes.

On 2 and 3 ranks and a 2 x 2 mesh, pooled and sequence collections, every sharding type (the
mixed plans hold all five; each uniform plan one), one SGD step of a loss linear in the output
(so both runs get the same output gradient) with the pooled outputs and the gradients sent in
float16/bfloat16, bfloat16/bfloat16 and float8_e4m3fn/float32, against the same step sent in
float32:

- each output value within u_f x (the lookup over |rows|) + the dtype's subnormal step per
  sender: every value that travels is rounded once (u = eps / 2), a rank's own part not at all;
- each table value within lr x u_b x (the job's gradient over |weights| and |gradients|);
  tables whose gradients travel in float32, and the data-parallel tables, bit for bit;
- the bytes each rank really sends: the float32 exchange's x itemsize / 4, plus one flag per
  other rank for the range-limited float16 and float8 pooled outputs (none where every table
  is replicated: no pooled exchange runs); and exchange_bytes' prediction for the wire dtype.

And pooled values beyond float16's range stop every rank with NonFiniteError naming the sender
and, on it, the table.
"""

from __future__ import annotations

from typing import Any

import embedding_cases as bags
import pytest
import sequence_cases as seq
import torch
from embedding_cases import SEED, coefficients
from tiny_tables import good_batch, tiny_tables

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingCollection,
    EmbeddingPlan,
    WireDtypes,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.planning import ExchangeBytes, exchange_bytes
from manualpar.errors import NonFiniteError
from manualpar.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

LR = 0.5
BATCH = 4
WIRES = {
    "fp16/bf16": WireDtypes(torch.float16, torch.bfloat16),
    "bf16/bf16": WireDtypes(torch.bfloat16, torch.bfloat16),
    "e4m3/fp32": WireDtypes(torch.float8_e4m3fn, torch.float32),
}
KINDS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
EXCHANGED = {"pooled output all_to_all": "pooled", "output gradient all_to_all": "gradients"}


def _cases(world: int) -> list[tuple[str, bool, EmbeddingPlan, bool]]:
    """(name, sequence, plan, weighted)."""
    cases = [("mixed weighted", False, bags.mixed_plan(world), True)]
    cases += [(kind, False, bags.uniform_plan(kind, world), False) for kind in KINDS]
    cases.append(("sequence mixed", True, seq.mixed_plan(world), False))
    return cases


def _features(sequence: bool, rank: int, weighted: bool) -> mp.embeddings.SparseFeatures:
    if sequence:
        return seq.make_batch(rank, 0, BATCH)
    return bags.make_batch(rank, 0, BATCH, weighted)


def _collection(sequence: bool) -> EmbeddingBagCollection:
    return (
        EmbeddingCollection(seq.TABLES, seed=SEED)
        if sequence
        else EmbeddingBagCollection(bags.TABLES, seed=SEED)
    )


def _outputs(out: Any) -> dict[str, torch.Tensor]:
    """Pooled: the (batch, dims) block; sequence: each feature's rows."""
    if isinstance(out, mp.embeddings.PooledEmbeddings):
        return {"pooled": out.values}
    return {feature: out[feature].values for feature in seq.FEATURES}


def _loss(outputs: dict[str, torch.Tensor], rank: int, sign: bool = True) -> torch.Tensor:
    """Linear in the outputs: its gradient does not depend on them (nor on the wire)."""
    total = torch.zeros(())
    for index, (_, values) in enumerate(sorted(outputs.items())):
        coef = coefficients(rank, index, values.shape[0], values.shape[1])
        total = total + (values * (coef if sign else coef.abs())).sum()
    return total / BATCH


def _step(
    strategy: mp.ManualParallelStrategy, case: tuple, wire: WireDtypes | None, mesh: Any
) -> dict[str, Any]:
    """One step: this rank's outputs, the full tables after it, and the bytes it sent."""
    _, sequence, plan, weighted = case
    with mp.empty_init():
        collection = _collection(sequence)
    emb = shard_embeddings(collection, strategy, plan, SGD(lr=LR), wire_dtype=wire, mesh=mesh)
    sent = {"pooled": 0, "gradients": 0}
    start = strategy.all_to_all_async

    def recording(tensor, send, receive, *, name="", group=None):  # type: ignore[no-untyped-def]
        for suffix, kind in EXCHANGED.items():
            if name.endswith(suffix):
                sent[kind] += sum(send) * tensor.element_size()
        return start(tensor, send, receive, name=name, group=group)

    strategy.all_to_all_async = recording  # type: ignore[method-assign]
    try:
        outputs = _outputs(emb(_features(sequence, strategy.rank, weighted)))
        _loss(outputs, strategy.rank).backward()
    finally:
        del strategy.all_to_all_async
    with full_tensors():
        tables = {k.split(".")[1]: v.clone() for k, v in emb.state_dict().items()}
    return {"out": {k: v.detach() for k, v in outputs.items()}, "tables": tables, "sent": sent}


def _bounds(strategy: mp.ManualParallelStrategy, case: tuple) -> dict[str, Any]:
    """The unsharded lookup over |rows| (forward bound) and the job's table gradient over
    |weights| and |loss coefficients| (backward bound), per element."""
    _, sequence, _, weighted = case
    features = _features(sequence, strategy.rank, weighted)  # weights are >= 0
    absolute = _collection(sequence)
    with torch.no_grad():
        for table in absolute.tables.values():
            table.weight.abs_()
    forward = {k: v.detach() for k, v in _outputs(absolute(features)).items()}
    plain = _collection(sequence)
    (_loss(_outputs(plain(features)), strategy.rank, sign=False) / strategy.world_size).backward()
    grads = {}
    for name, table in plain.tables.items():
        grad = table.weight.grad
        dense = torch.zeros_like(table.weight) if grad is None else grad.to_dense()
        grads[name] = strategy.all_reduce(dense.detach().contiguous(), op="sum")
    return {"forward": forward, "backward": grads}


def _unit(dtype: torch.dtype) -> float:
    return 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2


def _model(case: tuple, wire: WireDtypes, world: int) -> ExchangeBytes:
    """The byte model's step for every rank's batch (a 1-D job)."""
    _, sequence, plan, weighted = case
    batches = [_features(sequence, rank, weighted) for rank in range(world)]
    return exchange_bytes(seq.TABLES if sequence else bags.TABLES, plan, batches, wire=wire)


def _check(case: tuple, wire_name: str, got: dict, ref: dict, bound: dict, group: int) -> None:
    name, _, plan, _ = case
    wire = WIRES[wire_name]
    where = f"{name}, {wire_name}"
    u_f, u_b = _unit(wire.forward), _unit(wire.backward)
    step = torch.finfo(wire.forward).tiny * torch.finfo(wire.forward).eps  # subnormal spacing
    for key, expected in ref["out"].items():
        limit = u_f * bound["forward"][key] + group * step / 2 + 1e-6
        error = (got["out"][key] - expected).abs()
        assert bool((error <= limit).all()), (where, key, float((error - limit).max()))
    for table, expected in ref["tables"].items():
        actual = got["tables"][table]
        if u_b == 0 or plan.tables[table].sharding == "data_parallel":
            assert torch.equal(actual, expected), (where, table)
            continue
        limit = LR * u_b * bound["backward"][table] + 1e-6
        error = (actual - expected).abs()
        assert bool((error <= limit).all()), (where, table, float((error - limit).max()))
    flag = (group - 1) * (wire.forward.itemsize if wire.forward != torch.bfloat16 else 0)
    if all(p.sharding == "data_parallel" for p in plan.tables.values()):
        flag = 0  # nothing routed: no pooled exchange runs, so no flag travels
    pooled = ref["sent"]["pooled"] * wire.forward.itemsize // 4 + flag
    gradients = ref["sent"]["gradients"] * wire.backward.itemsize // 4
    assert got["sent"] == {"pooled": pooled, "gradients": gradients}, (where, got["sent"])


def compare_wires(mesh_shape: tuple[int, int] | None = None) -> list[str]:
    """Every case and wire against float32 on this rank; returns what ran."""
    strategy = mp.ManualParallelStrategy()
    mesh = None
    if mesh_shape is not None:
        mesh = strategy.mesh(replicate=mesh_shape[0], shard=mesh_shape[1])
    group = strategy.world_size if mesh_shape is None else mesh_shape[1]
    ran = []
    for case in _cases(group):
        ref = _step(strategy, case, None, mesh)
        bound = _bounds(strategy, case)
        for wire_name, wire in WIRES.items():
            got = _step(strategy, case, wire, mesh)
            _check(case, wire_name, got, ref, bound, group)
            if mesh is None:  # the byte model predicts the real splits
                model = _model(case, wire, group).bytes
                predicted = {k: sum(model[k][strategy.rank]) for k in ("pooled", "gradients")}
                assert got["sent"] == predicted, (case[0], wire_name, got["sent"], predicted)
            ran.append(f"{case[0]} {wire_name}")
    strategy.teardown()
    return ran


def overflow_in_float16() -> str:
    """Pooled values past 65504 on rank 0's user rows (row-wise: rank 1's bag [2, 3] is summed
    there): every rank stops with NonFiniteError."""
    strategy = mp.ManualParallelStrategy()
    ebc = EmbeddingBagCollection(tiny_tables(), seed=0)
    with torch.no_grad():
        ebc.tables["user"].weight.fill_(40000.0)
    emb = shard_embeddings(
        ebc,
        strategy,
        {"user": row_wise(), "item": table_wise(1)},
        SGD(lr=0.1),
        wire_dtype=WireDtypes(forward=torch.float16, backward=torch.bfloat16),
    )
    try:
        emb(good_batch())
    except NonFiniteError as error:
        return str(error)
    finally:
        strategy.teardown()
    return "no error"


@pytest.mark.parametrize("world", [2, 3])
def test_half_exchanges_stay_within_their_bound_on_ranks(world: int) -> None:
    ran = run_distributed(compare_wires, world)
    assert ran[0] == ran[-1] and len(ran[0]) == 7 * len(WIRES)


def test_half_exchanges_stay_within_their_bound_on_a_2x2_mesh() -> None:
    ran = run_distributed(compare_wires, 4, args=((2, 2),), local_world_size=2)
    assert len(ran[0]) == 7 * len(WIRES)


def test_float16_pooled_overflow_stops_every_rank_naming_sender_and_table() -> None:
    sender, receiver = run_distributed(overflow_in_float16, 2)
    common = (
        "pooled output exchanged in float16 holds values beyond its range (|value| > 65504) "
        "from shard-group rank 0"
    )
    assert common in sender and "this rank's tables: 'user'" in sender, sender
    assert common in receiver and "their errors name the tables" in receiver, receiver
    assert "wire_dtype=WireDtypes(forward=torch.bfloat16" in receiver
