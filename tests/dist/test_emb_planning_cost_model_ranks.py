"""The planner's cost model counts the bytes a real step sends, per rank, per direction and per
link: on 4 ranks of two simulated nodes and on a 2 x 2 mesh (its shard groups' exchanges, and
the sizes that every rank sends every rank of the job), a step's all_to_all splits (ids, pooled
rows, output gradients, sizes) summed over same-node and other-node peers equal the model's
sent/received intra/inter bytes exactly, for every placement
kind, with the exchanges in float32 and in the half wire dtypes (bf16: the pooled rows and
gradients in half the bytes; fp16: float16 rows and their overflow flags). The batch spreads
its ids evenly over each table's row blocks, as the model assumes."""

from __future__ import annotations

from dataclasses import replace

import pytest

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    column_wise,
    data_parallel,
    row_wise,
    shard_embeddings,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.exchange_layout import WIRE_NAMES
from manualpar.embeddings.planning import Workload, load_topology, plan_costs, rule_costs
from manualpar.embeddings.planning.cost_model import collection_costs, shard_group
from manualpar.testing import run_distributed

CONFIGS = [
    EmbeddingBagConfig("user", 64, 8),
    EmbeddingBagConfig("item", 40, 6, feature_names=("item", "last_item")),
    EmbeddingBagConfig("wide", 32, 12),
    EmbeddingBagConfig("cold", 16, 4),
    EmbeddingBagConfig("site", 48, 4),
    EmbeddingBagConfig("tiny", 8, 4),
]
BATCH, PER_BAG = 8, 1  # every rank: 8 samples, 1 id a bag in every feature (a row block then
# returns exactly its expected share of the bags: exchange_bytes.expected_kept)
# the sizes and ids all_to_alls both end with "ids all_to_all" (step/exchange.py)
EXCHANGE_NAMES = ("ids all_to_all", "pooled output all_to_all", "output gradient all_to_all")
WIRES = ("fp32", "bf16", "fp16")  # shard_embeddings' wire_dtype, each priced as Workload.wire
Recorded = dict[str, tuple[list[int], list[int], int]]


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


def _recording(strategy, start, sent, received, halved):  # type: ignore[no-untyped-def]
    """`start` (all_to_all_async), adding the bytes of the step's exchanges to `sent` and
    `received` per peer, and those of the pooled and gradient exchanges to `halved[0]`."""

    def recording(tensor, send, receive, *, name="", group=None):  # type: ignore[no-untyped-def]
        if name.endswith(EXCHANGE_NAMES):
            members = group.mesh.flatten().tolist() if group is not None else range(len(send))
            for index, peer in enumerate(members):
                if peer != strategy.rank:
                    sent[peer] += send[index] * tensor.element_size()
                    received[peer] += receive[index] * tensor.element_size()
                    if not name.endswith("ids all_to_all"):
                        halved[0] += send[index] * tensor.element_size()
        return start(tensor, send, receive, name=name, group=group)

    return recording


def _recorded(two_d: bool) -> Recorded:
    """Per wire dtype, the bytes this rank's exchanges sent to and received from each rank of
    the job, and those its pooled and gradient exchanges sent."""
    strategy = mp.ManualParallelStrategy()
    mesh = strategy.mesh(replicate=2, shard=2) if two_d else None
    shards = 2 if two_d else strategy.world_size
    start = strategy.all_to_all_async
    recorded = {}
    for wire in WIRES:
        with mp.empty_init():
            ebc = EmbeddingBagCollection(CONFIGS, seed=0)
        emb = shard_embeddings(
            ebc, strategy, _plan(shards), RowWiseAdagrad(lr=0.1), mesh=mesh, wire_dtype=wire
        )
        emb.tables["cold"].weight.requires_grad_(False)
        sent, received = [0] * strategy.world_size, [0] * strategy.world_size
        halved = [0]
        recording = _recording(strategy, start, sent, received, halved)
        strategy.all_to_all_async = recording  # type: ignore[method-assign]
        features = _even_batch(strategy.rank % shards, shards)
        emb(features).values.sum().backward()
        recorded[wire] = (sent, received, halved[0])
    strategy.teardown()
    return recorded


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
    for wire in WIRES:
        wired = WIRE_NAMES[wire]
        costs = plan_costs(sharded, plan, group, replace(workload, wire=wired))
        if two_d:  # and the sizes to the other group's ranks, as the 2-D layout's costs add
            beyond = collection_costs(sharded, plan, topology, 2, wired)
            costs = costs + beyond - collection_costs(sharded, plan, group, 1, wired)
        for rank, by_wire in enumerate(recorded):
            sent, received, halved = by_wire[wire]
            me = rank % shards
            peers = [p for p in range(4) if p != rank]  # (another group's: the sizes)
            same = [p for p in peers if p // 2 == rank // 2]
            other = [p for p in peers if p // 2 != rank // 2]

            def total(values: list[int], ranks: list[int]) -> int:
                return sum(values[p] for p in ranks)

            where = (wire, rank)
            assert total(sent, same) == costs.sent_intra[me].item(), (where, "sent intra")
            assert total(sent, other) == costs.sent_inter[me].item(), (where, "sent inter")
            assert total(received, same) == costs.received_intra[me].item(), (where, "recv intra")
            assert total(received, other) == costs.received_inter[me].item(), (where, "recv inter")
            assert costs.sent[me].item() > 0
            flags = (shards - 1) * 2 if wire == "fp16" else 0  # one float16 value a peer
            assert halved * (1 if wire == "fp32" else 2) == by_wire["fp32"][2] + 2 * flags, where
