"""The bytes each rank sends per step, as `expected_sent_bytes` (the `plan` command's bytes
line) and the cost model (`plan_costs`) count them, agree: for a batch per feature
(bags_per_feature, as PlanOptions') on every placement kind, and for a plan whose tables are
all replicated, which still sends its sizes every step but nothing else, no half wire's
overflow flag either (a real step's bytes: tests/dist/test_emb_planning_variable_batch_ranks.py),
to every rank of the job in a 2-D layout too."""

from __future__ import annotations

import pytest
from test_emb_planning_cost_model import CONFIGS, PER_BAG, SEQUENCE, _plan, _topology

from manualpar.embeddings import EmbeddingBagConfig, EmbeddingPlan, data_parallel, table_wise
from manualpar.embeddings.exchange_layout import FOLD_MAX, WIRE_NAMES
from manualpar.embeddings.planning import Workload, placement_costs, plan_costs
from manualpar.embeddings.planning.cost_model import collection_costs
from manualpar.embeddings.planning.exchange_bytes import (
    expected_exchange_bytes,
    expected_sent_bytes,
)
from manualpar.errors import PlanError

PER_FEATURE = {f: PER_BAG[c.name] for c in CONFIGS for f in c.feature_names}
OWN = {"user": 5.0, "last_item": 3.0}  # of 16 samples; "site" is split by rows and nodes


@pytest.mark.parametrize(
    ("world", "per_node", "full_rows"), [(2, 2, False), (3, 3, True), (4, 2, True)]
)
def test_a_batch_per_feature_sends_what_the_cost_model_prices(
    world: int, per_node: int, full_rows: bool
) -> None:
    plan, frozen = _plan(world, per_node), frozenset({"cold"})
    options = {"frozen": frozen, "full_rows": full_rows}
    sent = expected_sent_bytes(CONFIGS, plan, 16, PER_FEATURE, bags_per_feature=OWN, **options)
    matrix = expected_exchange_bytes(
        CONFIGS, plan, 16, PER_FEATURE, bags_per_feature=OWN, **options
    )
    workload = Workload(16, PER_BAG, OWN, frozen=frozen, full_rows=full_rows)
    costs = plan_costs(CONFIGS, plan, _topology(world, per_node), workload)
    assert sent == pytest.approx(costs.sent.tolist(), rel=1e-14, abs=0)
    assert sent == pytest.approx([matrix.sent(r) for r in range(world)], rel=1e-14, abs=0)
    full = expected_sent_bytes(CONFIGS, plan, 16, PER_FEATURE, **options)
    assert all(own < every for own, every in zip(sent, full, strict=True))
    # a count equal to the batch is a full batch: nothing changes
    named = dict.fromkeys(PER_FEATURE, 16)
    assert (
        expected_sent_bytes(CONFIGS, plan, 16, PER_FEATURE, bags_per_feature=named, **options)
        == full
    )


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_a_replicated_plan_still_sends_its_sizes(wire: str) -> None:
    world, per_node = 4, 2
    plan = EmbeddingPlan(world, {c.name: data_parallel() for c in CONFIGS})
    topology, workload = _topology(world, per_node), Workload(16, PER_BAG, wire=WIRE_NAMES[wire])
    costs = plan_costs(CONFIGS, plan, topology, workload)
    for config in CONFIGS:  # less the gradients' all_reduce: not an exchange
        costs = costs - placement_costs(config, plan.tables[config.name], topology, workload)
    # [batch, payload length, bits, frozen flags] in int64; no pooled rows, so no float16 flag
    per_peer = 4 * 8
    assert costs.sent_intra.tolist() == [per_peer] * world
    assert costs.sent_inter.tolist() == [2 * per_peer] * world
    sent = expected_sent_bytes(CONFIGS, plan, 16, PER_FEATURE, wire=WIRE_NAMES[wire])
    assert sent == [(world - 1) * per_peer] * world == costs.sent.tolist()


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_the_sizes_go_to_every_rank_of_the_job(replicas: int) -> None:
    """A 2-D layout's sizes cross the shard groups (StepParts.exchange_headers): 8 ranks, 4 a
    node; no float16 flag, as no pooled rows travel (a routed table's:
    tests/dist/test_emb_planning_cost_model_ranks.py)."""
    world, per_node, shard = 8, 4, 8 // replicas
    plan = EmbeddingPlan(shard, {c.name: data_parallel() for c in CONFIGS})
    costs = collection_costs(
        CONFIGS, plan, _topology(world, per_node), replicas, WIRE_NAMES["fp16"]
    )
    assert costs.sent_intra.tolist() == [(per_node - 1) * 32] * shard
    assert costs.received_inter.tolist() == [(world - per_node) * 32] * shard


def test_a_sequence_feature_cannot_have_bags_of_its_own() -> None:
    with pytest.raises(PlanError, match=r"features \['user'\] of sequence table 'user'"):
        expected_sent_bytes(SEQUENCE, _plan(2, 2), 16, PER_FEATURE, bags_per_feature={"user": 4})
    with pytest.raises(PlanError, match="bag counts must be >= 0"):
        expected_sent_bytes(CONFIGS, _plan(2, 2), 16, PER_FEATURE, bags_per_feature={"user": -1})


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_replicated_plan_pays_its_sizes_exchanges_latency(replicas: int) -> None:
    """Tables all replicated: the gradients' all_reduce and the sizes all_to_all, two calls'
    latency; a routed plan's sizes are one of its four exchanges (rank_costs.CALLS), inside the
    ids all_to_all on a 1-D mesh (16 samples: short payloads), so three there."""
    world, per_node = 4, 2
    topology, workload = _topology(world, per_node), Workload(16, PER_BAG)
    shard = world // replicas
    replicated = EmbeddingPlan(shard, {c.name: data_parallel() for c in CONFIGS})
    routed = EmbeddingPlan(shard, {c.name: table_wise(0) for c in CONFIGS})
    for plan, calls in ((replicated, 2), (routed, 3 if replicas == 1 else 4 + 2)):
        costs = plan_costs(CONFIGS, plan, topology, workload, replicas=replicas)
        latency = costs.seconds(topology) - costs.seconds(topology, latency=False)
        expected = calls * topology.inter_node_latency
        assert latency.tolist() == pytest.approx([expected] * shard, rel=1e-9), plan


@pytest.mark.parametrize(
    ("tables", "rows", "dim", "per_bag", "replicas", "calls"),
    [
        (26, 200_000, 16, 1.0, 1, 3),  # 13 x (1,024 lengths + 1,024 ids) int64 a peer: 213 KB
        (8, 1_000_000, 64, 20.0, 1, 4),  # 4 x (1,024 + 20,480): 688 KB a peer, over FOLD_MAX
        (26, 200_000, 16, 1.0, 2, 4 + 2),  # a 2-D mesh: the separate sizes, and the combine
    ],
)
def test_a_steady_1d_step_sends_its_sizes_with_short_ids(
    tables: int, rows: int, dim: int, per_bag: float, replicas: int, calls: int
) -> None:
    """From a collection's second step on, a 1-D mesh's sizes ride in the ids all_to_all while
    no rank's ids payload to another exceeds FOLD_MAX values (step/ids_exchange.py): 3 calls,
    not 4, as tests/dist/test_emb_step_ids_exchange_ranks.py counts them; 1,024 samples a rank,
    tables alternating over the shard group's 2 ranks."""
    configs = [EmbeddingBagConfig(f"t{i}", rows, dim) for i in range(tables)]
    plan = EmbeddingPlan(2, {c.name: table_wise(i % 2) for i, c in enumerate(configs)})
    topology = _topology(2 * replicas, 2 * replicas)
    workload = Workload(1024, {c.name: per_bag for c in configs})
    costs = plan_costs(configs, plan, topology, workload, replicas=replicas)
    per_peer = tables // 2 * 1024 * (1 + per_bag) * 8
    assert costs.ids_in.tolist() == [per_peer] * 2
    assert (per_peer <= FOLD_MAX * 8) == (tables == 26)
    assert costs.collectives == calls
