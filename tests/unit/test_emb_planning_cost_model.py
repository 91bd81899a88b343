"""The cost model's bytes per rank are exchange_bytes' matrices summed, without the matrices: per
direction, split by node, on 2, 3 and 4 ranks and every placement kind (the matrices themselves
are checked against real exchanges in tests/dist/test_emb_planning_exchange_bytes_ranks.py).
Its memory is the plan's bytes per rank; its seconds follow the topology."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from manualpar.embeddings import (
    Adam,
    DiskTier,
    EmbeddingBagConfig,
    EmbeddingConfig,
    EmbeddingPlan,
    TablePlacement,
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.planning.cost_model import placement_costs, plan_costs
from manualpar.embeddings.planning.exchange_bytes import (
    EXCHANGES,
    expected_exchange_bytes,
    expected_sent_bytes,
)
from manualpar.embeddings.planning.popularity import distinct_rows
from manualpar.embeddings.planning.topology import TOPOLOGY_PRESETS, Topology, load_topology
from manualpar.embeddings.planning.workload import Workload, sequence_padding
from manualpar.errors import PlanError

CONFIGS = [
    EmbeddingBagConfig("user", 60, 8),
    EmbeddingBagConfig("item", 40, 6, feature_names=("item", "last_item")),
    EmbeddingBagConfig("wide", 30, 12),
    EmbeddingBagConfig("cold", 20, 4, dtype=torch.float16),
    EmbeddingBagConfig("site", 48, 4),
]
PER_BAG = {"user": 2.0, "item": 1.5, "wide": 3.0, "cold": 1.0, "site": 2.5}


def _plan(world: int, per_node: int) -> EmbeddingPlan:
    return EmbeddingPlan(
        world,
        {
            "user": row_wise(),
            "item": table_wise(world - 1),
            "wide": column_wise(list(range(world))),
            "cold": row_wise(),
            "site": table_row_wise(world // per_node - 1, per_node),
        },
    )


def _topology(world: int, per_node: int) -> Topology:
    return load_topology("cpu-host", world, per_node)


# The same tables in a sequence collection (one row per id, a compact exchange), whose
# features are padded to the collection's largest id count (Workload.padded_ids)
SEQUENCE = [
    EmbeddingConfig(
        c.name, c.num_embeddings, c.embedding_dim, feature_names=c.feature_names, dtype=c.dtype
    )
    for c in CONFIGS
]


@pytest.mark.parametrize(
    ("world", "per_node", "weighted", "full_rows", "sequence"),
    [
        (2, 2, False, False, False),
        (3, 3, True, True, False),
        (4, 2, False, True, False),
        (4, 1, True, False, False),
        (2, 2, False, False, True),
        (4, 2, False, True, True),
    ],
)
def test_bytes_per_rank_are_the_exact_matrices_summed(
    world: int, per_node: int, weighted: bool, full_rows: bool, sequence: bool
) -> None:
    plan, topology = _plan(world, per_node), _topology(world, per_node)
    frozen = frozenset({"cold"})
    configs = SEQUENCE if sequence else CONFIGS
    padded = sequence_padding({c.name: c for c in configs}, PER_BAG)
    assert padded == (dict.fromkeys(PER_BAG, 3.0) if sequence else {})  # "wide": 3 ids a bag
    workload = Workload(
        16, PER_BAG, weighted=weighted, frozen=frozen, full_rows=full_rows, padded_ids=padded
    )
    per_feature = {f: PER_BAG[c.name] for c in configs for f in c.feature_names}
    matrix = expected_exchange_bytes(
        configs, plan, 16, per_feature, weighted=weighted, frozen=frozen, full_rows=full_rows
    )
    costs = plan_costs(configs, plan, topology, workload)
    for rank in range(world):
        node = rank // per_node

        def total(sender: int, receiver: int) -> float:
            return sum(matrix.bytes[k][sender][receiver] for k in EXCHANGES)

        same = [r for r in range(world) if r // per_node == node and r != rank]
        other = [r for r in range(world) if r // per_node != node]
        assert costs.sent_intra[rank].item() == pytest.approx(sum(total(rank, r) for r in same))
        assert costs.sent_inter[rank].item() == pytest.approx(sum(total(rank, r) for r in other))
        assert costs.received_intra[rank].item() == pytest.approx(sum(total(r, rank) for r in same))
        assert costs.received_inter[rank].item() == pytest.approx(
            sum(total(r, rank) for r in other)
        )
        assert costs.sent[rank].item() == pytest.approx(matrix.sent(rank))
    # the same sums without the matrices (what `plan --batch-per-rank` prints at any scale),
    # added in another order: equal to the last bits
    replicated = EmbeddingPlan(world, {**plan.tables, "user": data_parallel()})
    for placed in (plan, replicated):
        sums = expected_exchange_bytes(
            configs, placed, 16, per_feature, weighted=weighted, frozen=frozen, full_rows=full_rows
        )
        sent = expected_sent_bytes(
            configs, placed, 16, per_feature, weighted=weighted, frozen=frozen, full_rows=full_rows
        )
        assert sent == pytest.approx([sums.sent(r) for r in range(world)], rel=1e-14, abs=0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_memory_per_rank_is_the_plans_bytes(world: int) -> None:
    plan = _plan(world, 1 if world == 4 else world)
    workload = Workload(8, state=Adam.STATE)
    costs = plan_costs(CONFIGS, plan, _topology(world, 1 if world == 4 else world), workload)
    assert costs.memory.tolist() == plan.bytes_per_rank(CONFIGS, Adam.STATE)


def test_a_replicated_table_all_reduces_its_dense_gradient() -> None:
    config = EmbeddingBagConfig("tiny", 10, 4)
    topology = _topology(4, 2)
    costs = placement_costs(config, data_parallel(), topology, Workload(8))
    ring = 2 * 3 / 4 * 10 * 5 * 4  # rows x (dim + count) float32
    assert costs.sent_inter.tolist() == [ring] * 4 and costs.sent_intra.sum() == 0
    frozen = placement_costs(
        config, data_parallel(), topology, Workload(8, frozen=frozenset({"tiny"}))
    )
    assert frozen.sent.sum() == 0 and frozen.memory.tolist() == costs.memory.tolist()


def test_a_disk_table_holds_its_cache_in_memory_and_reads_its_misses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = EmbeddingBagConfig("huge", 1000, 8)
    topology = _topology(2, 2)
    tier = DiskTier(tmp_path, cache_rows=100)
    memory = placement_costs(config, row_wise(), topology, Workload(64))
    disk = placement_costs(config, row_wise(on_disk=True), topology, Workload(64), tier)
    row_bytes = 8 * 4 + 4  # weights + the row-wise state float
    # the cached rows, the evicted ones on their way to the file (a 1/16 of the slots, rounded
    # up), and the cache's bookkeeping: 4 bytes a block row, 37 a slot
    assert disk.memory.tolist() == [(100 + 7) * row_bytes + 500 * 4 + 100 * 37] * 2
    assert disk.disk.tolist() == memory.memory.tolist() == [500 * row_bytes] * 2
    assert disk.sent.tolist() == memory.sent.tolist()  # the same exchanges
    assert (disk.disk_rows > 0).all() and memory.disk_rows.sum() == 0
    # the model adds exactly the disk IO to the same lookups, updates and exchanges
    disk_io = (
        disk.disk_traffic / topology.disk_bandwidth + disk.disk_rows * topology.disk_row_seconds
    )
    assert (disk.seconds(topology) - memory.seconds(topology)).tolist() == pytest.approx(
        disk_io.tolist()
    )


def test_seconds_follow_the_slower_link() -> None:
    config = EmbeddingBagConfig("big", 10_000, 64)
    one_node = load_topology("h100-nvlink-ndr", 16, 16)
    two_nodes = load_topology("h100-nvlink-ndr", 16, 8)
    work = Workload(4096, {"big": 20.0})
    fast = placement_costs(config, row_wise(), one_node, work).seconds(one_node)
    slow = placement_costs(config, row_wise(), two_nodes, work).seconds(two_nodes)
    assert (slow > fast).all()


def test_topologies_load_from_presets_and_files_and_say_what_is_wrong(tmp_path) -> None:  # type: ignore[no-untyped-def]
    topology = load_topology("a100-nvlink-hdr", 64)
    assert (topology.ranks_per_node, topology.nodes) == (8, 8)
    assert load_topology("a100-nvlink-hdr", 4).ranks_per_node == 4  # one partial node
    path = tmp_path / "mine.json"
    path.write_text(topology.to_json())
    assert load_topology(path, 64) == topology
    mine = load_topology(path, 16, 4)
    assert (mine.name, mine.world_size, mine.ranks_per_node) == ("a100-nvlink-hdr", 16, 4)
    with pytest.raises(PlanError, match=r"neither a preset .* nor a file; make one with"):
        load_topology("no-such", 4)
    path.write_text('{"memory_bandwidth": 1}')
    with pytest.raises(PlanError, match=r"missing fields .*device_memory_bytes"):
        load_topology(path, 4)
    with pytest.raises(PlanError, match="ranks_per_node=3 must divide world_size=4"):
        load_topology("cpu-host", 4, 3)
    assert set(TOPOLOGY_PRESETS) >= {"cpu-host", "a100-nvlink-hdr", "h100-nvlink-ndr"}


@pytest.mark.parametrize(
    ("skew", "beyond"), [(0.0, 0), (0.0, 300), (1.05, 0), (1.05, 50), (0.8, 0)]
)
def test_distinct_rows_match_a_simulation(skew: float, beyond: int) -> None:
    """The expected distinct rows (past the `beyond` most popular) of uniform and Zipf draws,
    against counting them in 200 simulated draws of 3,000 ids from 20,000 rows."""
    rows, draws, trials = 20_000, 3_000, 200
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    weights = ranks.pow(-skew)
    counted = 0.0
    for _ in range(trials):
        drawn = torch.multinomial(weights, draws, replacement=True, generator=g)
        counted += (drawn.unique() >= beyond).sum().item() / trials
    assert distinct_rows(torch.tensor(float(draws)), rows, skew, beyond).item() == pytest.approx(
        counted, rel=0.02
    )


def test_skewed_ids_update_fewer_rows_and_miss_the_cache_less(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = EmbeddingBagConfig("huge", 1_000_000, 16)
    topology = _topology(2, 2)
    tier = DiskTier(tmp_path, cache_rows=50_000)
    uniform = placement_costs(
        config, row_wise(on_disk=True), topology, Workload(512, {"huge": 20}), tier
    )
    zipf = placement_costs(
        config, row_wise(on_disk=True), topology, Workload(512, {"huge": 20}, skew=1.05), tier
    )
    assert (zipf.rows_touched < uniform.rows_touched).all()
    assert (zipf.disk_rows < 0.5 * uniform.disk_rows).all()
    assert zipf.sent.tolist() == uniform.sent.tolist()  # the same ids travel


def test_ranks_sharing_a_nodes_cores_take_at_least_their_share_of_its_work() -> None:
    config = EmbeddingBagConfig("big", 100_000, 32)
    own = dataclasses.replace(load_topology("cpu-host", 4, 4), cores_per_node=0)
    shared = dataclasses.replace(own, cores_per_node=2)
    costs = placement_costs(config, table_wise(0), own, Workload(512, {"big": 10.0}))
    alone, together = costs.seconds(own), costs.seconds(shared)
    assert together.tolist() == pytest.approx(
        torch.clamp(alone, min=float(alone.sum()) / 2).tolist()
    )
    assert together[0] == alone[0] and (together[1:] > alone[1:]).all()  # the owner is busiest


def test_sequence_tables_are_padded_to_their_collections_largest_ids_per_sample() -> None:
    seq = SEQUENCE[0]
    tables = {"a.x": seq, "a.y": seq, "b.z": seq, "b.w": CONFIGS[0]}  # b.w: a bag table
    per_bag = {"a.x": 2.0, "a.y": 5.0, "b.z": 1.0, "b.w": 9.0}
    groups = {"a.x": "a", "a.y": "a", "b.z": "b", "b.w": "b"}
    assert sequence_padding(tables, per_bag, groups) == {"a.x": 5.0, "a.y": 5.0, "b.z": 1.0}
    assert sequence_padding(tables, per_bag) == {"a.x": 5.0, "a.y": 5.0, "b.z": 5.0}


def test_a_row_split_over_a_group_of_nodes_returns_only_the_bags_with_ids_in_each_block() -> None:
    """Why the planner offers row splits over groups of nodes: a row block returns pooled rows,
    and takes gradients, only for the bags with an id in its rows (step/exchange.py), so with
    one id a bag, each of 4 blocks sends a quarter of what a whole table's owner sends (by
    hand: batch / 4 x dim float32 to each other rank); every block still takes every bag's
    length."""
    config = EmbeddingBagConfig("hot", 800, 16)
    world, per_node, batch = 8, 2, 32
    topology = _topology(world, per_node)  # 4 nodes of 2 ranks
    group = row_wise(range(4, 8))  # nodes 2 and 3
    row = 16 * 4  # one float32 row
    for placement, blocks in ((table_wise(4), 1), (table_row_wise(2, per_node), 2), (group, 4)):
        matrix = expected_exchange_bytes(
            [config], EmbeddingPlan(world, {"hot": placement}), batch, {}
        )
        pooled = batch // blocks * row
        assert matrix.bytes["pooled"][4] == [pooled] * 4 + [0] + [pooled] * 3
        flags = [0 if r == 4 else 4 for r in range(world)]  # the non-finite flag after each
        grads = [matrix.bytes["gradients"][r][4] - flags[r] for r in range(world)]
        assert grads == matrix.bytes["pooled"][4]
    # the group's every owner, by hand: a quarter of the pooled rows to 7 ranks, and its own
    # bags' lengths, ids and gradients (a quarter each) to the 3 other owners
    matrix = expected_exchange_bytes([config], EmbeddingPlan(world, {"hot": group}), batch, {})
    quarter = batch // 4
    by_hand = 7 * quarter * row + 3 * (batch * 8 + quarter * 8 + quarter * row)
    # (less the sizes and the non-finite flags every rank sends every other one)
    assert [matrix.sent(r) - 7 * 4 * 8 - 7 * 4 for r in range(4, 8)] == [by_hand] * 4
    costs = placement_costs(config, group, topology, Workload(batch))
    assert costs.sent[4:].tolist() == [by_hand] * 4
    # at scale: a 40M-row table's slowest rank, whole (11.8 ms), over a node (1.79 ms) and over
    # 2, 4 and 16 nodes (1.08, 0.72 and 0.46 ms): each group of nodes faster
    big = EmbeddingBagConfig("cat_0", 39_884_406, 128)
    h100 = load_topology("h100-nvlink-ndr", 1024)
    work = Workload(1024, full_rows=True)

    def slowest(placement: TablePlacement) -> float:
        return float(placement_costs(big, placement, h100, work).seconds(h100).max())

    times = [slowest(table_wise(0)), slowest(table_row_wise(0, 8))]
    times += [slowest(row_wise(range(8 * k))) for k in (2, 4, 16)]
    assert times == sorted(times, reverse=True)
    assert times[-1] < times[0] / 20


def test_a_feature_with_its_own_bags_is_priced_by_them() -> None:
    """Workload.bags_per_feature: a feature of 64 bags for 512 samples costs its table fewer
    bytes and less time than the full batch; a one-feature table is priced as at a batch of
    its bags (plus the bag count each route sends); a full batch named so is unchanged."""
    topology = _topology(4, 2)
    item = CONFIGS[1]  # features "item" and "last_item"
    full = Workload(512, PER_BAG)
    own = Workload(512, PER_BAG, bags_per_feature={"last_item": 64})
    named_full = Workload(512, PER_BAG, bags_per_feature={"item": 512, "last_item": 512})
    for placement in (table_wise(1), row_wise(), column_wise([0, 1]), data_parallel()):
        whole = placement_costs(item, placement, topology, full)
        fewer = placement_costs(item, placement, topology, own)
        # predicted seconds: the cost model's arithmetic on bytes and rows, no clock is read
        assert fewer.seconds(topology).max() < whole.seconds(topology).max(), placement
        assert fewer.rows_touched.sum() < whole.rows_touched.sum(), placement
        if placement.sharding in ("table_wise", "column_wise"):  # (a row split's blocks
            assert fewer.sent.sum() < whole.sent.sum(), placement  # take every bag back)
        same = placement_costs(item, placement, topology, named_full)
        for key, value in vars(whole).items():
            named = vars(same)[key]
            assert named == value if isinstance(value, dict) else torch.equal(named, value), key
    user = CONFIGS[0]
    for placement in (table_wise(1), column_wise([0, 1])):
        alone = placement_costs(user, placement, topology, Workload(64, PER_BAG))
        own_bags = placement_costs(
            user, placement, topology, Workload(512, PER_BAG, bags_per_feature={"user": 64})
        )
        heads = 8 * 3 * len(placement.ranks)  # one int64 per route, from each other rank
        assert own_bags.sent.sum() == alone.sent.sum() + heads, placement
        assert torch.equal(own_bags.memory_traffic, alone.memory_traffic), placement
    with pytest.raises(PlanError, match=r"features \['user'\] of sequence table 'user'"):
        placement_costs(
            SEQUENCE[0], table_wise(0), topology, Workload(bags_per_feature={"user": 8})
        )
    with pytest.raises(PlanError, match=r"bag counts must be >= 0, got \{'user': -1\}"):
        placement_costs(user, table_wise(0), topology, Workload(bags_per_feature={"user": -1}))


def test_the_planner_prices_bags_per_feature_and_plans_a_full_batch_as_before() -> None:
    from manualpar.embeddings.planning import PlanOptions, plan_tables
    from manualpar.embeddings.planning.planner import Pricing

    tables = {c.name: c for c in CONFIGS}
    options = PlanOptions(batch_per_rank=512, bags_per_feature={"user": 8})
    workload = Pricing(options).workload(tables, PER_BAG)
    assert workload.bags_per_feature == {"user": 8} and workload.bags(CONFIGS[0]) == 8
    plain = plan_tables(CONFIGS, 4, batch_per_rank=512, pooling_factors=PER_BAG)
    named = plan_tables(
        CONFIGS,
        4,
        batch_per_rank=512,
        pooling_factors=PER_BAG,
        bags_per_feature={f: 512 for c in CONFIGS for f in c.feature_names},
    )
    assert named.to_json() == plain.to_json()
