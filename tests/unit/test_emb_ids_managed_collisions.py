"""ManagedCollisions on one process: exact mappings under lru and lfu, hot ids kept and cold
ones evicted, eval mode, buckets, stats and bad settings (sharded:
tests/dist/test_emb_ids_raw_ids_ranks.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import EmbeddingBagCollection, EmbeddingBagConfig, SparseFeatures
from manualpar.embeddings.ids.buckets import buckets_of
from manualpar.embeddings.ids.managed_collisions import (
    ManagedCollisionRemapper,
    ManagedCollisionTable,
)
from manualpar.embeddings.kernels.native import native_kernels
from manualpar.errors import EmbeddingInputError

MASK = 2**64 - 1


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _hash(raw_id: int, salt: int = 0) -> int:
    return _mix((raw_id & MASK) ^ _mix((salt + 0x9E3779B97F4A7C15) & MASK))


def _shared_row(raw_id: int, bucket_rows: int) -> int:
    """The documented row of an id that holds none (one bucket starting at row 0)."""
    return _mix(_hash(raw_id)) % bucket_rows


def _one_bucket(policy: str, rows: int = 4) -> EmbeddingBagCollection:
    setting = mp.ManagedCollisions(policy=policy, bucket_rows=rows)
    return EmbeddingBagCollection([EmbeddingBagConfig("t", rows, 2, raw_ids=setting)])


def _remap(ebc: EmbeddingBagCollection, ids: list[int]) -> list[int]:
    """One step of the collection's remapper: the rows of `ids`."""
    assert isinstance(ebc.raw_id_remap, ManagedCollisionRemapper)
    return ebc.raw_id_remap(SparseFeatures.from_dict({"t": [ids]})).values.tolist()


STEPS = ([10, 10, 10, 11, 12, 13], [10, 11, 12], [14], [15, 10], [16, 17, 18, 19, 20])
# per policy, each step's rows (20 finds every row of the bucket taken this step: it shares one)
EXPECTED = {
    "lru": [[0, 0, 0, 1, 2, 3], [0, 1, 2], [3], [1, 0], [2, 3, 0, 1, _shared_row(20, 4)]],
    "lfu": [[0, 0, 0, 1, 2, 3], [0, 1, 2], [3], [3, 0], [3, 1, 2, 0, _shared_row(20, 4)]],
}
STATS = [  # ids, new, collisions, evictions per step (the same under both policies here)
    (4, 4, 0, 0),
    (3, 0, 0, 0),
    (1, 1, 1, 1),
    (2, 1, 1, 1),
    (5, 5, 5, 4),
]


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_exact_mapping_and_stats_per_step(
    policy: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lru step 4: 11 and 12 were seen at step 2, 14 at step 3: 15 takes 11's row (the lower
    one). lfu step 4: 14 was seen once, 11 and 12 twice: 15 takes 14's row. Both the C++ remap
    and the torch path (the GPU's)."""
    if not native:
        monkeypatch.setattr(ManagedCollisionTable, "_native_takes", lambda self, ids: False)
    elif native_kernels() is None:
        pytest.skip("the C++ kernels could not be built on this machine")
    ebc = _one_bucket(policy)
    assert ebc.raw_id_remap is not None
    for step, ids in enumerate(STEPS):
        assert _remap(ebc, ids) == EXPECTED[policy][step], f"step {step + 1}"
        stats = ebc.raw_id_remap.raw_id_stats(reset=True)["t"]
        assert tuple(stats.values()) == STATS[step], f"step {step + 1}"
    table = ebc.raw_id_remap.table("t")
    assert table.step.item() == 5
    assert table.ids.tolist() == ([18, 19, 16, 17] if policy == "lru" else [19, 17, 18, 16])


def test_lru_keeps_the_id_seen_every_step_and_cycles_the_cold_ones() -> None:
    ebc = _one_bucket("lru")
    for step in range(8):
        cold = 100 + step
        rows = _remap(ebc, [7, cold])
        assert rows == [0, 1 + step % 3], f"step {step + 1}"  # 7 holds row 0 throughout


def test_lfu_keeps_the_frequent_id_while_it_is_absent() -> None:
    ebc = _one_bucket("lfu")
    assert _remap(ebc, [7] * 5 + [1, 2, 3]) == [0] * 5 + [1, 2, 3]
    # two cold ids a step take the rows seen least often (once), the least recent of them
    # first: never 7's, seen 5 times
    expected = [[1, 2], [3, 1], [2, 1], [3, 1], [2, 1], [3, 1]]
    for step, rows in enumerate(expected):
        assert _remap(ebc, [100 + 2 * step, 101 + 2 * step]) == rows, f"step {step + 2}"
    assert _remap(ebc, [7]) == [0]
    assert ebc.raw_id_remap is not None and ebc.raw_id_remap.table("t").counts[0].item() == 6


def test_eval_mode_maps_held_ids_and_shares_rows_for_new_ones_without_changing_state() -> None:
    ebc = _one_bucket("lru")
    _remap(ebc, [10, 11])
    assert ebc.raw_id_remap is not None
    before = {k: v.clone() for k, v in ebc.raw_id_remap.state_dict().items()}
    ebc.eval()
    assert _remap(ebc, [11, 10, 99]) == [1, 0, _shared_row(99, 4)]
    after = ebc.raw_id_remap.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert ebc.raw_id_remap.raw_id_stats()["t"]["ids"] == 2  # the training step only


def test_ids_fill_only_their_own_bucket() -> None:
    """Two buckets of 2 rows: three ids of bucket 0 evict among themselves; bucket 1's id
    keeps its row."""
    setting = mp.ManagedCollisions(bucket_rows=2)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", 4, 2, raw_ids=setting)])
    zero = [i for i in range(100) if _hash(i) % 2 == 0][:3]
    one = next(i for i in range(100) if _hash(i) % 2 == 1)
    assert _remap(ebc, [one, zero[0], zero[1]]) == [2, 0, 1]
    assert _remap(ebc, [zero[2]]) == [0]  # evicts zero[0] (row 0, as old as row 1)
    assert _remap(ebc, [one]) == [2]


def test_pooled_lookup_reads_the_remapped_rows() -> None:
    ebc = _one_bucket("lru")
    pooled = ebc(SparseFeatures.from_dict({"t": [[-5, 2**63 - 1], [-5]]})).values
    weight = ebc.tables["t"].weight
    torch.testing.assert_close(pooled, torch.stack([weight[0] + weight[1], weight[0]]))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: mp.ManagedCollisions(policy="fifo"),
            "ManagedCollisions: policy must be one of ('lru', 'lfu'), got 'fifo'",
        ),
        (
            lambda: mp.ManagedCollisions(bucket_rows=0),
            "ManagedCollisions: bucket_rows must be a positive int, got 0",
        ),
        (
            lambda: mp.ManagedCollisions(salt=-1),
            "ManagedCollisions: salt must be an int in [0, 2**64), got -1",
        ),
        (
            lambda: mp.HashIds(salt=2**64),
            "HashIds: salt must be an int in [0, 2**64), got 18446744073709551616",
        ),
        (
            lambda: EmbeddingBagConfig("t", 4, 2, raw_ids="hash"),  # type: ignore[arg-type]
            "table 't': raw_ids must be None, HashIds(...) or ManagedCollisions(...), got 'hash'",
        ),
    ],
    ids=["policy", "bucket_rows", "salt", "hash_salt", "raw_ids"],
)
def test_bad_settings_raise_naming_the_value(make: object, message: str) -> None:
    with pytest.raises(EmbeddingInputError) as error:
        make()  # type: ignore[operator]
    assert str(error.value) == message


def test_sharding_a_trained_collection_and_loading_its_state_keep_the_mapping() -> None:
    tables = [EmbeddingBagConfig("t", 10, 2, raw_ids=mp.ManagedCollisions(bucket_rows=3))]
    ebc = EmbeddingBagCollection(tables)
    for step in range(3):
        ebc(SparseFeatures.from_dict({"t": [[step * 7 + i for i in range(6)], [-step]]}))
    state = {k: v.clone() for k, v in ebc.state_dict().items() if k.startswith("raw_id_remap.")}
    strategy = mp.ManualParallelStrategy()
    from_trained = mp.shard_embeddings(ebc, strategy, rule=mp.embeddings.SGD(lr=0.1))
    fresh = mp.shard_embeddings(
        EmbeddingBagCollection(tables), strategy, rule=mp.embeddings.SGD(lr=0.1)
    )
    fresh.load_state_dict(ebc.state_dict())  # plain (full) tensors into the sharded module
    for emb in (from_trained, fresh):
        with full_tensors():
            got = emb.state_dict()
        for key, tensor in state.items():
            assert torch.equal(got[key], tensor), key


def test_both_ways_of_finding_held_ids_agree() -> None:
    """Sorting the held ids or comparing with the bucket's rows (chosen by size) find the
    same rows, held or not, in a full table with a short last bucket."""
    setting = mp.ManagedCollisions(bucket_rows=8)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", 60, 2, raw_ids=setting)])
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        _remap(ebc, (torch.randint(-(2**62), 2**62, (40,), generator=generator)).tolist())
    assert ebc.raw_id_remap is not None
    table = ebc.raw_id_remap.table("t")
    held = table.ids[table.last_seen != 0]
    ids = torch.unique(torch.cat([held, torch.tensor([-3, 5, 2**40])]))
    bucket = buckets_of(ids, table.config)
    by_sort = table._held_by_sort(ids, torch.nonzero(table.last_seen).flatten())
    in_buckets = table._held_in_buckets(ids, bucket)
    assert torch.equal(by_sort, in_buckets)
    assert (by_sort >= 0).sum() == held.numel() and torch.equal(
        table.ids[by_sort[by_sort >= 0]], held.sort().values
    )


def test_the_planner_counts_the_remappers_state_on_every_rank() -> None:
    """3 int64 per managed row, the buckets split over every rank: 1000 rows of 64-row buckets
    on 2 ranks are 8 buckets each, at most 512 rows, 12,288 bytes per rank, whatever the
    tables' placement."""
    from manualpar.embeddings.ids.buckets import remapper_bytes_per_rank
    from manualpar.embeddings.planning.planner import plan_tables
    from manualpar.errors import PlanError

    managed = EmbeddingBagConfig("user", 1000, 4, raw_ids=mp.ManagedCollisions())
    hashed = EmbeddingBagConfig("item", 1000, 4, raw_ids=mp.HashIds())
    assert remapper_bytes_per_rank([managed, hashed], 2) == 512 * 24
    # each table is 1000 x (4 weights + 1 row-wise state) x 4 bytes = 20,000 bytes, at least
    # 20,000 per rank for both; a budget of 20,000 leaves 7,712 once the remappers hold theirs
    assert plan_tables([managed, hashed], 2, memory_budget_bytes=60_000).world_size == 2
    with pytest.raises(PlanError, match=r"more than the budget of 7\.5 KiB"):
        plan_tables([managed, hashed], 2, memory_budget_bytes=20_000)
    with pytest.raises(PlanError) as error:
        plan_tables([managed, hashed], 2, memory_budget_bytes=12_000)
    assert str(error.value) == (
        "the managed-collision remappers' state takes 12.0 KiB per rank on 2 ranks (3 int64 per "
        "row of the ManagedCollisions tables), the whole budget of 11.7 KiB; raise the memory "
        "budget, use more ranks, or give those tables fewer rows"
    )


def test_a_managed_table_placed_whole_holds_its_whole_remapper_on_its_rank() -> None:
    """Placed whole on one rank, a managed table is remapped there (no remap exchange) and that
    rank holds all 24 bytes per row; the planner adds it beyond the shares it counts on every
    rank, in both methods (and a row block's beyond them)."""
    from manualpar.embeddings import row_wise, table_wise
    from manualpar.embeddings.ids.buckets import remapper_bytes_at_owner
    from manualpar.embeddings.planning import Workload
    from manualpar.embeddings.planning.cost_model import placement_costs
    from manualpar.embeddings.planning.planner import plan_tables
    from manualpar.embeddings.planning.topology import load_topology

    managed = EmbeddingBagConfig("user", 1000, 4, raw_ids=mp.ManagedCollisions())
    hashed = EmbeddingBagConfig("item", 1000, 4, raw_ids=mp.HashIds())
    assert remapper_bytes_at_owner(managed, 2) == 488 * 24  # 1000 rows less the share of 512
    assert remapper_bytes_at_owner(hashed, 2) == 0
    # 20,000 bytes of table; the shares take 12,288 of each rank's budget first: whole on a
    # rank the managed table needs 31,712 more there, so 40,000 splits it and 52,000 does not
    for budget, sharding in ((40_000, "row_wise"), (52_000, "table_wise")):
        plan = plan_tables(
            [managed, hashed], 2, memory_budget_bytes=budget, price="memory", replicate_bytes=0
        )
        assert plan.tables["user"].sharding == sharding, budget
    topology = load_topology("cpu-host", 2, 2)
    whole = placement_costs(managed, table_wise(1), topology, Workload()).memory
    split = placement_costs(managed, row_wise(), topology, Workload()).memory
    assert whole.tolist() == [0.0, 20_000.0 + 488 * 24]
    # rows split in whole 64-row buckets, each block remapped by its owner: no rank holds more
    # remapper state than the 512 rows counted on every rank
    assert split.tolist() == [512 * 20.0, 488 * 20.0]


def test_a_uniform_plan_counts_the_remapper_state_each_rank_holds() -> None:
    """plan_uniform and `python -m manualpar plan --plan KIND` count what each rank holds of
    the remappers under the plan: whole tables' on their rank, row blocks' (in whole 64-row
    buckets) on theirs, a replicated table's buckets split over every rank (tests/dist/
    test_emb_ids_raw_ids_ranks.py checks these against the state the ranks hold)."""
    from manualpar.embeddings.planning import remapper_bytes_on_ranks
    from manualpar.embeddings.planning.planner import plan_uniform
    from manualpar.errors import PlanError

    managed = EmbeddingBagConfig("user", 1000, 4, raw_ids=mp.ManagedCollisions())
    hashed = EmbeddingBagConfig("item", 1000, 4, raw_ids=mp.HashIds())
    tables = [managed, hashed]
    whole = plan_uniform("table_wise", tables, 2)  # user alone on rank 0, item on rank 1
    assert remapper_bytes_on_ranks(whole, tables) == [1000 * 24, 0]
    rows = plan_uniform("row_wise", tables, 2)  # 16 buckets: 8 (512 rows) and 7 (488)
    assert remapper_bytes_on_ranks(rows, tables) == [512 * 24, 488 * 24]
    replicated = plan_uniform("data_parallel", tables, 2)  # through the remap exchange, which
    assert remapper_bytes_on_ranks(replicated, tables) == [512 * 24, 488 * 24]  # splits buckets
    # the cost model's memory (what the plan command prints) counts at least that, and exactly
    # it on the managed table's owner: its share (512 rows) and the rest of its 1000
    from manualpar.embeddings.planning import Workload
    from manualpar.embeddings.planning.cost_model import plan_costs
    from manualpar.embeddings.planning.topology import load_topology

    costs = plan_costs(tables, whole, load_topology("cpu-host", 2, 2), Workload())
    assert costs.memory.tolist() == [20_000.0 + 1000 * 24, 20_000.0 + 512 * 24]
    # rank 0 holds 20,000 bytes of table and 24,000 of remapper: a budget of 43,999 is short
    assert plan_uniform("table_wise", tables, 2, memory_budget_bytes=44_000) == whole
    with pytest.raises(PlanError) as error:
        plan_uniform("table_wise", tables, 2, memory_budget_bytes=43_999)
    assert str(error.value) == (
        "plan table_wise puts 43.0 KiB on rank 0 (23.4 KiB of it the managed-collision "
        "remappers' state), more than the memory budget of 43.0 KiB; try plan 'auto', more "
        "ranks or a larger budget"
    )


@pytest.mark.parametrize("bucket_rows", [1, 7, 64])
def test_the_largest_row_block_is_the_largest_of_the_plans_row_blocks(bucket_rows: int) -> None:
    """One split in whole buckets (row_blocks.py): what the remappers' share counts on every
    rank (largest_row_block, ids/buckets.py) is the largest block a row-wise plan gives."""
    from manualpar.embeddings import row_wise
    from manualpar.embeddings.ids.buckets import remapper_bytes_per_rank
    from manualpar.embeddings.plan import EmbeddingPlan
    from manualpar.embeddings.row_blocks import largest_row_block, row_blocks

    for rows in (1, 5, 63, 64, 65, 1000, 4097):
        config = EmbeddingBagConfig(
            "t", rows, 4, raw_ids=mp.ManagedCollisions(bucket_rows=bucket_rows)
        )
        for parts in (1, 2, 3, 7, 16, 100):
            blocks = row_blocks(config, parts)
            assert blocks[0][0] == 0 and blocks[-1][1] == rows
            assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
            largest = max(end - start for start, end in blocks)
            assert largest_row_block(config, parts) == largest, (rows, parts)
            assert remapper_bytes_per_rank([config], parts) == largest * 24
            if rows >= parts:
                shards = EmbeddingPlan(parts, {"t": row_wise()}).shards(config)
                assert [(s.row_start, s.row_end) for s in shards] == blocks


def test_a_row_block_past_the_last_bucket_remaps_no_bucket() -> None:
    """100 rows in two 64-row buckets over 4 ranks: the blocks are 64, 36, 0 and 0 rows, and
    the ranks with empty blocks hold no bucket (they held the last one twice over before)."""
    from manualpar.embeddings import row_wise
    from manualpar.embeddings.ids.buckets import layout_of, owner_blocks
    from manualpar.embeddings.plan import EmbeddingPlan
    from manualpar.embeddings.planning import remapper_bytes_on_ranks

    config = EmbeddingBagConfig("user", 100, 4, raw_ids=mp.ManagedCollisions(bucket_rows=64))
    plan = EmbeddingPlan(4, {"user": row_wise()})
    blocks = owner_blocks(config, plan)
    assert blocks == {0: (0, 1), 1: (1, 2), 2: (2, 2), 3: (2, 2)}
    assert [layout_of(config).row_range(b) for b in blocks.values()] == [
        (0, 64),
        (64, 100),
        (100, 100),
        (100, 100),
    ]
    assert remapper_bytes_on_ranks(plan, [config]) == [64 * 24, 36 * 24, 0, 0]
    hashed = EmbeddingBagConfig("item", 100, 4, raw_ids=mp.HashIds())
    assert owner_blocks(hashed, EmbeddingPlan(4, {"item": row_wise()})) == {}
