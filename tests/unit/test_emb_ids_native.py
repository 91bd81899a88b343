"""The C++ raw-id kernels (kernels/csrc/raw_ids.cpp) against the torch path, the GPU's:
HashIds rows of a batch mixing hashed, managed and plain tables; managed collisions' rows, state
and stats step by step, under both policies, for whole tables and blocks of buckets, short last
buckets, repeated ids and eval steps; and the routing of a rank's raw ids to the buckets'
owners and to a row-split table's blocks."""

from __future__ import annotations

import pytest
import torch

from manualpar.embeddings import EmbeddingBagConfig, HashIds, ManagedCollisions, SparseFeatures
from manualpar.embeddings.ids import hashing
from manualpar.embeddings.ids.buckets import buckets_of, layout_of
from manualpar.embeddings.ids.hashing import salt_key
from manualpar.embeddings.ids.managed_collisions import ManagedCollisionTable
from manualpar.embeddings.kernels.native import native_kernels

pytestmark = pytest.mark.skipif(
    native_kernels() is None, reason="the C++ kernels could not be built on this machine"
)


def _table(policy: str, rows: int, bucket_rows: int, buckets: tuple[int, int] | None, native: bool):
    setting = ManagedCollisions(policy=policy, bucket_rows=bucket_rows, salt=5)
    config = EmbeddingBagConfig("t", rows, 4, raw_ids=setting)
    table = ManagedCollisionTable(config, buckets)
    table.native = native
    return config, table


def _steps(config: EmbeddingBagConfig, buckets: tuple[int, int] | None, steps: int):
    """Raw ids with repeats (counts above 1), in this block's buckets, some steps in eval."""
    generator = torch.Generator().manual_seed(0)
    rows = config.num_embeddings
    for step in range(steps):
        raw = torch.randint(-rows, 2 * rows, (rows // 2,), generator=generator)
        raw = torch.cat([raw, raw[: rows // 8]])
        if buckets is not None:
            bucket = buckets_of(raw, config)
            raw = raw[(bucket >= buckets[0]) & (bucket < buckets[1])]
        yield step % 7 != 6, raw


CASES = [
    ("lru", 1000, 64, None),
    ("lfu", 1000, 64, None),
    ("lru", 1003, 7, None),  # a short last bucket
    ("lfu", 1003, 7, (30, 100)),  # a block of buckets, as one rank holds
    ("lru", 200, 1, None),
    ("lfu", 5000, 1000, None),
]


@pytest.mark.parametrize(("policy", "rows", "bucket_rows", "buckets"), CASES)
def test_cpp_remap_equals_the_torch_path_step_by_step(policy, rows, bucket_rows, buckets):
    config, cpp = _table(policy, rows, bucket_rows, buckets, native=True)
    _, torch_path = _table(policy, rows, bucket_rows, buckets, native=False)
    for step, (training, raw) in enumerate(_steps(config, buckets, 24)):
        cpp.train(training)
        torch_path.train(training)
        if step % 2:  # distinct ascending ids with counts, as remap takes them
            distinct, counts = torch.unique(raw, return_counts=True)
            got, want = cpp.remap(distinct, counts), torch_path.remap(distinct, counts)
        else:  # any order, repeats, as remap_counted takes them
            got, want = cpp.remap_counted(raw), torch_path.remap_counted(raw)
        assert torch.equal(got, want), f"step {step}"
        for key in ("ids", "last_seen", "counts", "step"):
            assert torch.equal(getattr(cpp, key), getattr(torch_path, key)), (step, key)
    assert cpp.stats == torch_path.stats
    assert cpp.stats["evictions"] > 0 and cpp.stats["collisions"] > 0  # the cases bite


def test_counts_given_per_position_are_summed_per_id():
    _, cpp = _table("lfu", 64, 8, None, native=True)
    _, torch_path = _table("lfu", 64, 8, None, native=False)
    ids = torch.tensor([5, 9, 5, 7, 9, 5])
    counts = torch.tensor([1, 2, 3, 1, 1, 2])
    assert torch.equal(cpp.remap_counted(ids, counts), torch_path.remap_counted(ids, counts))
    assert torch.equal(cpp.counts, torch_path.counts)
    assert sorted(cpp.counts[cpp.counts > 0].tolist()) == [1, 3, 6]


def test_an_id_outside_the_block_is_refused_naming_its_bucket():
    config, cpp = _table("lru", 1000, 10, (0, 50), native=True)
    outside = next(i for i in range(10_000) if int(buckets_of(torch.tensor([i]), config)) >= 50)
    with pytest.raises(RuntimeError, match=r"hashes to bucket \d+, outside this block's buckets"):
        cpp.remap_counted(torch.tensor([outside]))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_route_sends_each_distinct_id_once_to_its_buckets_owner(world):
    setting = ManagedCollisions(bucket_rows=16, salt=3)
    config = EmbeddingBagConfig("t", 10_000, 4, raw_ids=setting)
    layout = layout_of(config)
    ends = torch.tensor([layout.owned(r, world)[1] for r in range(world)])
    raw = torch.randint(-(2**62), 2**62, (500,), generator=torch.Generator().manual_seed(2))
    raw = torch.cat([raw, raw[:200], raw[:50]])
    ids, counts, inverse, per_owner = native_kernels().managed_route(
        raw, salt_key(3), layout.num_buckets, ends
    )
    assert torch.equal(ids[inverse], raw)
    distinct, expected_counts = torch.unique(raw, return_counts=True)
    order = torch.argsort(ids)
    assert torch.equal(ids[order], distinct)
    assert torch.equal(counts[order], expected_counts)
    owner = torch.searchsorted(ends, buckets_of(ids, config), right=True)
    assert torch.equal(owner, torch.sort(owner).values)  # grouped by owner
    assert per_owner.tolist() == torch.bincount(owner, minlength=world).tolist()


@pytest.mark.parametrize("world", [1, 3])
def test_the_sharded_senders_route_equals_the_torch_route(world):
    """What a rank sends each owner (ids and counts, as sets) and how it reads the replies back."""
    from manualpar.embeddings.sharded import managed_collisions as sharded

    setting = ManagedCollisions(bucket_rows=16, salt=3)
    config = EmbeddingBagConfig("t", 10_000, 4, raw_ids=setting)
    layout = layout_of(config)
    ends = {"t": torch.tensor([layout.owned(r, world)[1] for r in range(world)])}
    raw = torch.randint(0, 3000, (900,), generator=torch.Generator().manual_seed(4))
    cpp = sharded._Sent(raw, config, ends)
    torch_route = sharded._Sent(raw, config, ends, native=False)
    assert cpp.per_rank == torch_route.per_rank
    for owner in range(world):
        got = dict(zip(*(t.tolist() for t in cpp.to_owner(owner)), strict=True))
        want = dict(zip(*(t.tolist() for t in torch_route.to_owner(owner)), strict=True))
        assert got == want, owner
    # an owner's reply per sent id: each raw id reads back the reply for itself
    assert torch.equal(cpp.rows(cpp.ids * 7), raw * 7)
    assert torch.equal(torch_route.rows(torch_route.ids * 7), raw * 7)


def test_hashing_a_batch_equals_the_torch_path(monkeypatch):
    tables = [
        EmbeddingBagConfig("a", 1000, 4, feature_names=["a1", "a2"], raw_ids=HashIds(salt=7)),
        EmbeddingBagConfig("plain", 50, 4),  # ids are rows already: kept
        EmbeddingBagConfig("m", 64, 4, raw_ids=ManagedCollisions()),  # remapped later: kept
        EmbeddingBagConfig("b", 3, 4, raw_ids=HashIds()),
    ]
    generator = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 6, (5 * 4,), generator=generator)
    values = torch.randint(-(2**63), 2**63 - 1, (int(lengths.sum()),), generator=generator)
    batch = SparseFeatures(["a1", "a2", "plain", "m", "b"], values, lengths)
    got = hashing.hash_raw_ids(batch, tables)
    monkeypatch.setattr(hashing, "native_kernels_take", lambda *tensors: False)
    want = hashing.hash_raw_ids(batch, tables)
    assert torch.equal(got.values, want.values)
    assert torch.equal(got.lengths, batch.lengths)
    kept = batch["plain"].values
    assert torch.equal(got["plain"].values, kept)
    assert torch.equal(got["m"].values, batch["m"].values)
    assert int(got["b"].values.max()) < 3 and int(got["a2"].values.max()) < 1000


def test_the_route_of_raw_ids_to_row_blocks_equals_the_torch_route():
    """Where the step sends a row-split managed table's raw ids (the first row of each id's
    bucket): the C++ hash and the torch ops agree."""
    import manualpar as mp
    from manualpar.embeddings import (
        EmbeddingBagCollection,
        RowWiseAdagrad,
        row_wise,
        shard_embeddings,
    )

    setting = ManagedCollisions(bucket_rows=16, salt=3)
    config = EmbeddingBagConfig("t", 1_000, 4, raw_ids=setting)
    emb = shard_embeddings(
        EmbeddingBagCollection([config], seed=0),
        mp.ManualParallelStrategy(),
        {"t": row_wise()},
        RowWiseAdagrad(lr=0.1),
    )
    routes = emb.raw_id_remap.owner_remap(["t"])  # one rank holds every bucket: remapped there
    raw = torch.randint(-(2**62), 2**62, (900,), generator=torch.Generator().manual_seed(4))
    cpp = routes.route_keys(0, raw)
    emb.raw_id_remap.table("t").native = False
    assert torch.equal(routes.route_keys(0, raw), cpp)
    assert torch.equal(cpp, buckets_of(raw, config) * 16)
