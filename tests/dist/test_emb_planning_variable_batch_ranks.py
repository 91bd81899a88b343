"""The cost model prices a batch per feature (Workload.bags_per_feature) as a real step sends it:
on 2 ranks, a step whose "user" feature holds 4 bags and "last_item" 2 for 8 samples sends, per
peer, the bytes the model counts (each distinct bag's length, ids, pooled row and gradient once,
a bag count per route, a row split's every bag), on every placement kind
(test_emb_planning_cost_model_ranks.py checks a full batch on 4 ranks), and so does
expected_sent_bytes(bags_per_feature=) (the `plan` command's bytes line). A step whose
tables are all replicated sends its sizes alone, in one all_to_all (no ids, no pooled rows, no
float16 overflow flag: nothing is routed, every rank knows it from the plan), as both count."""

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
    data_parallel,
    shard_embeddings,
)
from manualpar.embeddings.exchange_layout import WIRE_NAMES
from manualpar.embeddings.planning import (
    Workload,
    expected_sent_bytes,
    load_topology,
    placement_costs,
    plan_costs,
    rule_costs,
)
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


REPLICATED = EmbeddingPlan(2, {c.name: data_parallel() for c in CONFIGS})


Step = tuple[list[int], list[int], list[str]]  # sent, received per peer; the all_to_alls run


def _named(start, names):  # type: ignore[no-untyped-def]
    """`start`, adding the name of every all_to_all it starts to `names`."""

    def named(tensor, send, receive, *, name="", group=None):  # type: ignore[no-untyped-def]
        names.append(name)
        return start(tensor, send, receive, name=name, group=group)

    return named


def _recorded() -> list[Step]:
    """What this rank sent and received: a batch per feature's step, then a step of the
    replicated plan in float32 and in float16."""
    strategy = mp.ManualParallelStrategy()
    start = strategy.all_to_all_async
    out = []
    for plan, wire in ((_plan(2), "fp32"), (REPLICATED, "fp32"), (REPLICATED, "fp16")):
        with mp.empty_init():
            ebc = EmbeddingBagCollection(CONFIGS, seed=0)
        emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.1), wire_dtype=wire)
        emb.tables["cold"].weight.requires_grad_(False)
        sent, received, names = [0, 0], [0, 0], []
        recording = _recording(strategy, start, sent, received, [0])
        strategy.all_to_all_async = _named(recording, names)  # type: ignore[method-assign]
        emb(_variable_batch(strategy.rank)).values.sum().backward()
        out.append((sent, received, names))
    strategy.teardown()
    return out


@pytest.fixture(scope="module")
def recorded() -> list[list[Step]]:
    """Per rank, `_recorded`'s steps (one run of 2 ranks for both tests)."""
    return run_distributed(_recorded, 2, timeout=90)


@pytest.mark.timeout(120)
def test_the_cost_model_counts_every_byte_of_a_batch_per_feature(
    recorded: list[list[Step]],
) -> None:
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
    per_bag = {f: float(PER_BAG) for c in CONFIGS for f in c.feature_names}
    expected = expected_sent_bytes(
        CONFIGS,
        _plan(2),
        BATCH,
        per_bag,
        frozen=frozenset({"cold"}),
        full_rows=full_rows,
        bags_per_feature=OWN_BAGS,
    )
    for rank, ((sent, received, _), *_) in enumerate(recorded):
        peer = 1 - rank
        assert sent[peer] == costs.sent_intra[rank].item(), (rank, "sent")
        assert received[peer] == costs.received_intra[rank].item(), (rank, "received")
        assert sent[peer] == expected[rank], (rank, "expected_sent_bytes")
    full = plan_costs(sharded, plan, load_topology("cpu-host", 2, 2), Workload(BATCH))
    # fewer bags travel in all, though a row split's blocks take every bag's gradient back
    assert costs.sent_intra.sum() < full.sent_intra.sum()


@pytest.mark.timeout(120)
def test_a_step_of_replicated_tables_sends_its_sizes_as_both_models_count(
    recorded: list[list[Step]],
) -> None:
    topology = load_topology("cpu-host", 2, 2)
    for index, wire in ((1, "fp32"), (2, "fp16")):
        workload = Workload(BATCH, wire=WIRE_NAMES[wire])
        costs = plan_costs(CONFIGS, REPLICATED, topology, workload)
        for config in CONFIGS:  # less the gradients' all_reduce, not an all_to_all
            placement = REPLICATED.tables[config.name]
            costs = costs - placement_costs(config, placement, topology, workload)
        expected = expected_sent_bytes(CONFIGS, REPLICATED, BATCH, {}, wire=WIRE_NAMES[wire])
        for rank, by_plan in enumerate(recorded):
            sent, received, names = by_plan[index]
            peer = 1 - rank
            # 4 int64 sizes; no ids, no pooled rows and so no float16 overflow flag
            assert sent[peer] == received[peer] == 32, wire
            assert len(names) == 1 and names[0].endswith("ids all_to_all"), (wire, names)
            assert costs.sent_intra[rank].item() == sent[peer], (wire, rank, "plan_costs")
            assert expected[rank] == sent[peer], (wire, rank, "expected_sent_bytes")
