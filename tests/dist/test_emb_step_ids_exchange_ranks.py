"""The size header folded into the ids exchange (step/ids_exchange.py), on 3 gloo processes.

One job: the same steps through a collection whose sizes ride with its ids and one that
exchanges them apart (every step), with payloads that grow past their pair's room (the rest
point-to-point), shrink (padding) and differ per pair: the same outputs and rows, bit for bit,
one all_to_all fewer from the second step on, except after a step where one rank did not ask
for it, as the planner prices it. Then a rank refuses a batch on a folded step: every rank
stops with the refusal's error and the next step runs in step again. The strategy's
point-to-point transfers are checked on their own too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    SparseFeatures,
    column_wise,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.planning import Workload, load_topology, plan_costs
from manualpar.embeddings.step import ids_exchange
from manualpar.errors import ConfigError, EmbeddingInputError
from manualpar.testing import run_distributed

CONFIGS = [
    EmbeddingBagConfig("user", 30, 4),
    EmbeddingBagConfig("item", 20, 6, feature_names=("item", "last_item")),
    EmbeddingBagConfig("wide", 12, 6),
]
PLAN = EmbeddingPlan(3, {"user": row_wise(), "item": table_wise(2), "wide": column_wise([0, 1, 2])})
# ids per bag on each step: grows past every pair's room (2), then shrinks (padding)
PER_BAG = [1, 1, 4, 1, 0, 2, 3]


def _batch(rank: int, step: int) -> SparseFeatures:
    g = torch.Generator().manual_seed(100 * step + rank)
    per_bag = PER_BAG[step] + rank  # each pair's payload its own length
    bags = {
        feature: [
            torch.randint(0, rows, (per_bag + b % 2,), generator=g).tolist() for b in range(3)
        ]
        for feature, rows in (("user", 30), ("item", 20), ("last_item", 20), ("wide", 12))
    }
    return SparseFeatures.from_dict(bags)


def _collection(strategy: mp.ManualParallelStrategy) -> Any:
    with mp.empty_init():
        ebc = EmbeddingBagCollection(CONFIGS, seed=0)
    return shard_embeddings(ebc, strategy, PLAN, SGD(lr=0.1))


def _point_to_point(strategy: mp.ManualParallelStrategy) -> list[Any]:
    """Rank 0 sends rank 2 two tensors of one tag (they arrive in order); sending to oneself
    is a ConfigError."""
    got: list[Any] = []
    if strategy.rank == 0:
        sends = [strategy.send_async(torch.arange(n) * 10, 2, tag=7) for n in (3, 2)]
        for send in sends:
            send.wait()
    elif strategy.rank == 2:
        first, second = torch.empty(3, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
        receives = [strategy.receive_async(t, 0, tag=7) for t in (first, second)]
        got += [r.wait().tolist() for r in receives]
    try:
        strategy.send_async(torch.zeros(1), strategy.rank)
    except ConfigError as error:
        got.append(str(error))
    return got


def _steps() -> dict[str, Any]:
    strategy = mp.ManualParallelStrategy()
    folded, separate = _collection(strategy), _collection(strategy)
    separate.step.forward_phases.ids_exchange.enabled = False
    start, send = strategy.all_to_all_async, strategy.send_async
    calls: list[str] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("name", ""))
        return start(*args, **kwargs)

    def sent(*args: Any, **kwargs: Any) -> Any:
        calls.append("send")
        return send(*args, **kwargs)

    strategy.all_to_all_async = counted  # type: ignore[method-assign]
    strategy.send_async = sent  # type: ignore[method-assign]
    same, per_step, limit = [], [], ids_exchange.FOLD_MAX
    for step in range(len(PER_BAG)):
        # rank 2 does not ask for one exchange on step 4: step 5 sends the sizes apart
        ids_exchange.FOLD_MAX = 0 if step == 4 and strategy.rank == 2 else limit
        outs = []
        for emb in (folded, separate):
            calls.clear()
            out = emb(_batch(strategy.rank, step)).values
            (out * torch.arange(out.numel()).view_as(out)).sum().backward()
            outs.append(out.detach())
            if emb is folded:
                per_step.append(list(calls))
        same.append(torch.equal(*outs))
    rows = [
        torch.equal(folded.tables[c.name].weight, separate.tables[c.name].weight) for c in CONFIGS
    ]
    refusal = ""
    bad = SparseFeatures.from_dict({"user": [[99]], "item": [[0]], "last_item": [[]], "wide": [[]]})
    try:
        folded(bad if strategy.rank == 1 else _batch(strategy.rank, 0))
    except EmbeddingInputError as error:
        refusal = str(error)
    after = folded(_batch(strategy.rank, 1)).values  # the rooms still agree: runs in step
    after.sum().backward()
    strategy.all_to_all_async, strategy.send_async = start, send  # type: ignore[method-assign]
    p2p = _point_to_point(strategy)
    strategy.teardown()
    return {"same": same, "rows": rows, "calls": per_step, "refusal": refusal, "p2p": p2p}


@pytest.mark.timeout(120)
def test_sizes_ride_with_the_ids_bit_for_bit_and_refusals_stop_every_rank() -> None:
    results = run_distributed(_steps, world_size=3, timeout=90)
    for rank, result in enumerate(results):
        assert all(result["same"]), (rank, result["same"])
        assert all(result["rows"]), (rank, result["rows"])
        # the sizes ride with the ids (ids, pooled rows, gradients) once every rank asked for
        # it in the step before: not on the first step, nor after rank 2 did not ask (4)
        counts = [sum(n.endswith("all_to_all") for n in names) for names in result["calls"]]
        assert counts == [4, 3, 3, 3, 3, 4, 3], counts
        # every pair's payload outgrows its room at step 2: the rest point-to-point
        assert result["calls"][2].count("send") == 2, result["calls"][2]
        assert not any("send" in names for names in result["calls"][3:]), result["calls"]
        if rank == 1:
            assert "out of range" in result["refusal"], result["refusal"]
        else:
            assert result["refusal"].startswith("rank 1 refused its batch"), result["refusal"]
    assert results[2]["p2p"][:2] == [[0, 10, 20], [0, 10]]
    for result in results:
        assert "cannot send to or receive from itself" in result["p2p"][-1]
    # the planner prices the steady step's 3 (every table routed: no all_reduce)
    topology = load_topology("cpu-host", 3, 3)
    assert plan_costs(CONFIGS, PLAN, topology, Workload(3)).collectives == 3
