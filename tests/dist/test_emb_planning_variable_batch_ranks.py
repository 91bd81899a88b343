"""The cost model prices a batch per feature (Workload.bags_per_feature) as a real step sends it:
on 2 ranks, a step whose "user" feature holds 4 bags and "last_item" 2 for 8 samples sends, per
peer, the bytes the model counts (each distinct bag's length, ids, pooled row and gradient once,
a bag count per route, a row split's every bag), on every placement kind
(test_emb_planning_cost_model_ranks.py checks a full batch on 4 ranks)."""

from __future__ import annotations

import pytest
from test_emb_planning_cost_model_ranks import (
    BATCH,
    CONFIGS,
    PER_BAG,
    _even_batch,
    _plan,
    _recording,
)

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    shard_embeddings,
)
from manualpar.embeddings.planning import Workload, load_topology, plan_costs, rule_costs
from manualpar.testing import run_distributed

OWN_BAGS = {"user": 4, "last_item": 2}  # bags of 8 samples: sample b reads bag b % count


def _variable_batch(rank: int) -> SparseFeatures:
    plain = _even_batch(rank, 2)
    bags = {key: plain[key].to_lists() for key in plain.keys}
    inverse = {}
    for key, count in OWN_BAGS.items():
        bags[key] = bags[key][:count]
        inverse[key] = [b % count for b in range(BATCH)]
    return SparseFeatures.from_dict(bags, None, inverse)


def _recorded() -> tuple[list[int], list[int]]:
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        ebc = EmbeddingBagCollection(CONFIGS, seed=0)
    emb = shard_embeddings(ebc, strategy, _plan(2), RowWiseAdagrad(lr=0.1))
    emb.tables["cold"].weight.requires_grad_(False)
    sent, received = [0, 0], [0, 0]
    start = strategy.all_to_all_async
    strategy.all_to_all_async = _recording(strategy, start, sent, received, [0])  # type: ignore[method-assign]
    emb(_variable_batch(strategy.rank)).values.sum().backward()
    strategy.teardown()
    return sent, received


@pytest.mark.timeout(120)
def test_the_cost_model_counts_every_byte_of_a_batch_per_feature() -> None:
    recorded = run_distributed(_recorded, 2, timeout=90)
    state, full_rows = rule_costs(RowWiseAdagrad(lr=0.1))
    sharded = [c for c in CONFIGS if c.name != "tiny"]
    plan = EmbeddingPlan(2, {c.name: _plan(2).tables[c.name] for c in sharded})
    workload = Workload(
        BATCH,
        dict.fromkeys([c.name for c in CONFIGS], float(PER_BAG)),
        bags_per_feature={key: float(count) for key, count in OWN_BAGS.items()},
        frozen=frozenset({"cold"}),
        state=state,
        full_rows=full_rows,
    )
    costs = plan_costs(sharded, plan, load_topology("cpu-host", 2, 2), workload)
    for rank, (sent, received) in enumerate(recorded):
        peer = 1 - rank
        assert sent[peer] == costs.sent_intra[rank].item(), (rank, "sent")
        assert received[peer] == costs.received_intra[rank].item(), (rank, "received")
    full = plan_costs(sharded, plan, load_topology("cpu-host", 2, 2), Workload(BATCH))
    # fewer bags travel in all, though a row split's blocks take every bag's gradient back
    assert costs.sent_intra.sum() < full.sent_intra.sum()
