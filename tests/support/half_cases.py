"""Half-precision tables (float16, bfloat16) trained sharded, against a float64 reference.

The reference is the unsharded collection in float64, started from the half tables' initial
values (the float32 values rounded to the dtype) and trained with the same reference updates as
the float32 tests (embedding_cases.ReferenceUpdates). What remains between the two is the
rounding of each update back to the dtype, and its effect on the later steps' gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from embedding_cases import (
    SEED,
    STEPS,
    TABLES,
    ReferenceUpdates,
    local_loss,
    make_batch,
    mixed_plan,
    optimizer,
    train_and_collect,
    uniform_plan,
)

import manualpar as mp
from manualpar.embeddings import EmbeddingBagCollection, EmbeddingPlan, shard_embeddings

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Unit roundoff u: half the distance between 1 and the next number (2^-11 for float16's 11
# significant bits, 2^-8 for bfloat16's 8). An update rounded to nearest is off by at most
# u * |w|; stochastically, by less than one unit in the last place, 2u * |w|.
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
ELEMENTWISE = ("adagrad", "adam")  # rules that divide each element by its gradient's size


def half_tables(dtype: torch.dtype) -> tuple:
    return tuple(dataclasses.replace(t, dtype=dtype) for t in TABLES)


def plan_named(name: str, world: int) -> EmbeddingPlan:
    return mixed_plan(world) if name == "mixed" else uniform_plan(name, world)


def train_half(cases: Sequence[tuple[str, str, str]], batch_sizes: Sequence[int]) -> list[dict]:
    """On each rank, for every (plan, optimizer, dtype): STEPS steps; full tables and state."""
    strategy = mp.ManualParallelStrategy()
    rank = strategy.rank
    results = []
    for plan, opt_name, dtype in cases:
        with mp.empty_init():
            ebc = EmbeddingBagCollection(half_tables(DTYPES[dtype]), seed=SEED)
        emb = shard_embeddings(
            ebc, strategy, plan_named(plan, strategy.world_size), optimizer(opt_name)
        )
        results.append(train_and_collect(emb, rank, batch_sizes[rank]))
    strategy.teardown()
    return results


def float64_reference(
    opt_name: str, dtype: str, batch_sizes: Sequence[int]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, dict]]:
    """Step-0 outputs per rank, then float64 tables and state after STEPS steps."""
    ebc = EmbeddingBagCollection(TABLES, seed=SEED).double()
    params = {name: table.weight for name, table in ebc.tables.items()}
    with torch.no_grad():
        for p in params.values():  # the half table's initial values, exactly
            p.copy_(p.to(DTYPES[dtype]).double())
    updates = ReferenceUpdates(opt_name, params)
    updates.row_state = {name: torch.zeros(p.shape[0], dtype=p.dtype) for name, p in params.items()}
    world = len(batch_sizes)
    first = []
    for step in range(STEPS):
        loss = torch.zeros((), dtype=torch.float64)
        for rank, batch in enumerate(batch_sizes):
            pooled = ebc(make_batch(rank, step, batch)).values
            if step == 0:
                first.append(pooled.detach().clone())
            loss = loss + local_loss(pooled, rank, step) / world
        for p in params.values():
            p.grad = None
        loss.backward()
        updates.step()
    return first, {n: p.detach().clone() for n, p in params.items()}, updates.state()


def check_against_float64(
    per_rank: list[list[dict]],
    cases: Sequence[tuple[str, str, str]],
    batch_sizes: Sequence[int],
) -> None:
    """Every rank's result of every case within the dtype's rounding tolerance of float64.

    Tolerance, per table: each element takes at most STEPS updates and each rounds once, off by
    less than 2u|w| (one unit in the last place, stochastic) or u|w| (to nearest), so the mean
    absolute deviation is at most STEPS * 2u * mean|w| (measured: 0.7u for float16, 1.3u for
    bfloat16, after 3 steps). Each element is held to 16u * max|w| (measured: 2.7u) under SGD
    and row-wise Adagrad. Adagrad and Adam divide each element by its own gradient's size, so an
    element whose gradient nearly cancels steps by about lr with the gradient's sign, which a
    perturbation of u can flip: there at most 2% of elements go beyond 16u * max|w| (measured:
    1 element of 964), none beyond 2 * lr per step. Optimizer state is float32 and sees only
    the gradients' perturbation: within
    STEPS * 2u of its largest value (measured 2.4u). The step-0 output is summed in float32 from
    the same values: 1e-6.
    """
    references: dict[tuple[str, str], tuple] = {}
    for index, (plan, opt_name, dtype) in enumerate(cases):
        key = (opt_name, dtype)
        if key not in references:
            references[key] = float64_reference(opt_name, dtype, batch_sizes)
        ref_first, ref_tables, ref_state = references[key]
        u = UNIT_ROUNDOFF[dtype]
        for rank, results in enumerate(per_rank):
            got, where = results[index], f"{plan}, {opt_name}, {dtype}, rank {rank}"
            torch.testing.assert_close(
                got["first"].double(), ref_first[rank], rtol=0, atol=1e-6, msg=where
            )
            for name, expected in ref_tables.items():
                table = got["tables"][name]
                assert table.dtype == DTYPES[dtype], f"{where}: table {name} is {table.dtype}"
                deviation = (table.double() - expected).abs()
                mean_bound = STEPS * 2 * u * expected.abs().mean()
                assert deviation.mean() <= mean_bound, f"{where}: table {name} mean deviation"
                rounding_bound = 16 * u * expected.abs().max()
                beyond = deviation > rounding_bound
                if opt_name in ELEMENTWISE:  # a near-cancelling gradient's sign decides
                    assert beyond.float().mean() <= 0.02, f"{where}: table {name}: {beyond.sum()}"
                    bound = 2 * optimizer(opt_name).lr * STEPS
                    assert deviation.max() <= bound, f"{where}: table {name}: {deviation.max()}"
                else:
                    assert not beyond.any(), (
                        f"{where}: table {name} largest deviation {deviation.max():.3g}"
                    )
                for key_name, value in ref_state[name].items():
                    state = got["state"][name][key_name]
                    assert state.dtype == torch.float32, f"{where}: state {name}/{key_name}"
                    off = (state.double() - value).abs().max()
                    assert off <= STEPS * 2 * u * value.abs().max(), (
                        f"{where}: state {name}/{key_name} off by {off:.3g}"
                    )


def assert_same_bits_across_plans(
    results: list[dict], cases: Sequence[tuple[str, str, str]]
) -> None:
    """The rounding draws its bits by global position, so plans that compute the same float32
    values land on the same bits: table-wise, row-wise, column-wise and mixed (the fused
    kernel). Data-parallel tables take the row-sum path, whose float32 formula differs in the
    last bit now and then (as for float32 tables); a rare element then rounds the other way:
    at most 1% of elements, by one unit in the last place (measured: 1 of 964, float16)."""
    first_of: dict[tuple[str, str], int] = {}
    for index, (plan, opt_name, dtype) in enumerate(cases):
        base = first_of.setdefault((opt_name, dtype), index)
        for name, table in results[index]["tables"].items():
            expected = results[base]["tables"][name]
            where = f"{opt_name}, {dtype}: table {name} under {plan} vs {cases[base][0]}"
            if plan != "data_parallel":
                assert torch.equal(table, expected), f"{where}: not the same bits"
                continue
            differ = table != expected
            assert differ.float().mean() <= 0.01, f"{where}: {int(differ.sum())} elements differ"
            a, b = table[differ].double(), expected[differ].double()
            ulp = 2 * UNIT_ROUNDOFF[dtype] * torch.maximum(a.abs(), b.abs())
            assert ((a - b).abs() <= ulp).all(), f"{where}: more than one unit apart"
