"""The table batch (step/batched_tables.py) reads each table's weight where the module holds it
now: a weight replaced after the first batched step (a new Parameter, or new data under the
same one: `.data =`, `to()`) is looked up and updated, as on the per-table path."""

from __future__ import annotations

import pytest
import torch
from support.embedding_cases import feature_bags, one_process_tables
from torch import nn

import manualpar as mp
from manualpar.embeddings import (
    ShardedEmbeddingBagCollection,
    SparseFeatures,
)
from manualpar.embeddings.kernels.native import native_kernels

SIZES = ((50, 4), (30, 8), (7, 8))


def _batch(step: int) -> SparseFeatures:
    return feature_bags(SIZES, step, 4)


def _sharded() -> ShardedEmbeddingBagCollection:
    return one_process_tables(SIZES)


def _replace(emb: nn.Module, how: str) -> None:
    """Every table's weight replaced by new values: a loaded checkpoint (its hook copies them
    into the block in place), a new Parameter, new data under the same Parameter."""
    state = emb.state_dict()
    for table in emb.tables.values():
        new = torch.linspace(-1, 1, table.weight.numel()).view_as(table.weight)
        if how == "parameter":
            table.weight = nn.Parameter(new)
        elif how == "data":
            table.weight.data = new
        else:
            state[f"tables.{table.config.name}.weight"] = new
    if how == "load":
        emb.load_state_dict(state, assign=True)


def _train(batched: bool, how: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    emb = _sharded()
    emb.step.batches_tables = batched
    taken = []
    phases = emb.step.forward_phases
    lookup = phases._lookup_batched
    phases._lookup_batched = lambda *a: taken.append(1) or lookup(*a)  # type: ignore[method-assign]
    emb(_batch(0)).values.sum().backward()
    _replace(emb, how)
    out = emb(_batch(1)).values
    out.sum().backward()
    weights = {name: table.weight.detach().clone() for name, table in emb.tables.items()}
    return out.detach(), weights, len(taken)


@pytest.mark.skipif(native_kernels() is None, reason="no C++ kernels")
@pytest.mark.parametrize("how", ["load", "parameter", "data"])
def test_a_replaced_weight_is_looked_up_and_updated_by_the_batch(how: str) -> None:
    out, weights, taken = _train(True, how)
    expected_out, expected_weights, per_table = _train(False, how)
    assert (taken, per_table) == (2, 0)
    assert torch.equal(out, expected_out), "the batch looked the old weights up"
    for name, expected in expected_weights.items():
        assert torch.equal(weights[name], expected), f"{name}: the batch updated the old weights"


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("how", ["more rows", "fewer rows", "double"])
def test_a_weight_replaced_by_another_shape_or_dtype_stops_the_next_step(
    batched: bool, how: str
) -> None:
    """The optimizer's state keeps one row per block row in its dtype: the next step names the
    table, the rank, both shapes and dtypes and the fix, rather than fail in a kernel (or, on
    the per-table path, update rows with mismatched state silently)."""
    emb = _sharded()
    emb.step.batches_tables = batched
    emb(_batch(0)).values.sum().backward()
    if how == "double":
        emb.double()
        new = "50 x 4 torch.float64"
    else:
        rows = 200 if how == "more rows" else 10
        emb.tables["t0"].weight = nn.Parameter(torch.zeros(rows, 4))
        new = f"{rows} x 4 torch.float32"
    with pytest.raises(mp.errors.BuilderError) as raised:
        emb(_batch(1))
    message = str(raised.value)
    for part in ("'t0'", "rank 0", new, "50 x 4 torch.float32", "copy_", "shard_embeddings()"):
        assert part in message, part
