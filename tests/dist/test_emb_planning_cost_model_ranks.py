"""The planner's cost model counts the bytes a real step sends, per rank, per direction and per
link: on 4 ranks of two simulated nodes and within the shard groups of a 2 x 2 mesh, a step's
all_to_all splits (ids, pooled rows, output gradients, sizes) summed over same-node and
other-node peers equal the model's sent/received intra/inter bytes exactly, for every placement
kind. The batch spreads its ids evenly over each table's row blocks, as the model assumes."""

from __future__ import annotations

import pytest

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    Workload,
    column_wise,
    data_parallel,
    load_topology,
    plan_costs,
    row_wise,
    rule_costs,
    shard_embeddings,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.planning.cost_model import shard_group
from manualpar.testing import run_distributed

CONFIGS = [
    EmbeddingBagConfig("user", 64, 8),
    EmbeddingBagConfig("item", 40, 6, feature_names=("item", "last_item")),
    EmbeddingBagConfig("wide", 32, 12),
    EmbeddingBagConfig("cold", 16, 4),
    EmbeddingBagConfig("site", 48, 4),
    EmbeddingBagConfig("tiny", 8, 4),
]
BATCH, PER_BAG = 4, 2  # every rank: 4 samples, 2 ids a bag in every feature
# the sizes and ids all_to_alls both end with "ids all_to_all" (step/exchange.py)
EXCHANGE_NAMES = ("ids all_to_all", "pooled output all_to_all", "output gradient all_to_all")


def _plan(shards: int) -> EmbeddingPlan:
    return EmbeddingPlan(
        shards,
        {
            "user": row_wise(),
            "item": table_wise(shards - 1),
            "wide": column_wise(list(range(shards))),
            "cold": row_wise(),
            "site": table_row_wise(0, 2) if shards == 4 else table_wise(0),
            "tiny": data_parallel(),
        },
    )


def _even_batch(rank: int, shards: int) -> SparseFeatures:
    """Each feature's 8 ids fall evenly on the table's row blocks (of `shards` or 2 ranks)."""
    bags = {}
    for config in CONFIGS:
        blocks = 2 if config.name == "site" and shards == 4 else shards
        block_rows = config.num_embeddings // blocks
        for feature in config.feature_names:
            ids = [
                (j % blocks) * block_rows + (j // blocks + rank) % block_rows
                for j in range(BATCH * PER_BAG)
            ]
            bags[feature] = [ids[i * PER_BAG : (i + 1) * PER_BAG] for i in range(BATCH)]
    return SparseFeatures.from_dict(bags)


def _recorded(two_d: bool) -> tuple[list[int], list[int]]:
    """Bytes this rank's exchanges sent to and received from each rank of the job."""
    strategy = mp.ManualParallelStrategy()
    mesh = strategy.mesh(replicate=2, shard=2) if two_d else None
    shards = 2 if two_d else strategy.world_size
    with mp.empty_init():
        ebc = EmbeddingBagCollection(CONFIGS, seed=0)
    emb = shard_embeddings(ebc, strategy, _plan(shards), RowWiseAdagrad(lr=0.1), mesh=mesh)
    emb.tables["cold"].weight.requires_grad_(False)
    sent, received = [0] * strategy.world_size, [0] * strategy.world_size
    start = strategy.all_to_all_async

    def recording(tensor, send, receive, *, name="", group=None):  # type: ignore[no-untyped-def]
        if name.endswith(EXCHANGE_NAMES):
            members = group.mesh.flatten().tolist() if group is not None else range(len(send))
            for index, peer in enumerate(members):
                if peer != strategy.rank:
                    sent[peer] += send[index] * tensor.element_size()
                    received[peer] += receive[index] * tensor.element_size()
        return start(tensor, send, receive, name=name, group=group)

    strategy.all_to_all_async = recording  # type: ignore[method-assign]
    features = _even_batch(strategy.rank % shards, shards)
    emb(features).values.sum().backward()
    strategy.teardown()
    return sent, received


@pytest.mark.timeout(120)
@pytest.mark.parametrize("two_d", [False, True], ids=["4_ranks_2_nodes", "2x2_mesh"])
def test_the_cost_model_counts_every_byte_of_a_step(two_d: bool) -> None:
    recorded = run_distributed(_recorded, 4, args=(two_d,), timeout=90, local_world_size=2)
    topology = load_topology("cpu-host", 4, 2)
    state, full_rows = rule_costs(RowWiseAdagrad(lr=0.1))
    workload = Workload(
        BATCH,
        dict.fromkeys([c.name for c in CONFIGS], float(PER_BAG)),
        frozen=frozenset({"cold"}),
        state=state,
        full_rows=full_rows,
    )
    shards = 2 if two_d else 4
    group = shard_group(topology, 2) if two_d else topology
    # the exchanges alone: the shard group's own plan, without the replicas' sums
    sharded = [c for c in CONFIGS if c.name != "tiny"]
    plan = EmbeddingPlan(shards, {c.name: _plan(shards).tables[c.name] for c in sharded})
    costs = plan_costs(sharded, plan, group, workload)
    for rank, (sent, received) in enumerate(recorded):
        me = rank % shards
        peers = [p for p in range(4) if p != rank and (p // shards == rank // shards or not two_d)]
        same = [p for p in peers if p // 2 == rank // 2]
        other = [p for p in peers if p // 2 != rank // 2]

        def total(values: list[int], ranks: list[int]) -> int:
            return sum(values[p] for p in ranks)

        assert total(sent, same) == costs.sent_intra[me].item(), (rank, "sent intra")
        assert total(sent, other) == costs.sent_inter[me].item(), (rank, "sent inter")
        assert total(received, same) == costs.received_intra[me].item(), (rank, "recv intra")
        assert total(received, other) == costs.received_inter[me].item(), (rank, "recv inter")
        assert costs.sent[me].item() > 0
