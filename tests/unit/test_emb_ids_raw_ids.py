"""Raw int64 ids on one process: the documented hash (pinned rows), HashIds tables in the
unsharded collections and in the sharded one at world size 1 (2 and 3 ranks:
tests/dist/test_emb_ids_raw_ids_ranks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from raw_id_cases import (
    HASHED_TABLES,
    MANAGED_TABLES,
    RAW_POOL,
    check_against_reference,
    train_sharded,
)

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    SparseFeatures,
)
from manualpar.embeddings.ids.hashing import hashed_rows
from manualpar.errors import CheckpointMismatchError, EmbeddingInputError

IDS = [0, 1, 2, -1, -(2**63), 2**63 - 1, 123456789012345, 42]
# rows of IDS in a 1000-row table, pinned: a change of the hash would remap every trained table
PINNED = {
    0: [871, 807, 745, 904, 87, 760, 330, 910],
    7: [625, 367, 918, 445, 157, 44, 926, 453],
    2**64 - 1: [104, 333, 382, 771, 332, 993, 163, 462],
}
MASK = 2**64 - 1


def _mix(z: int) -> int:
    """splitmix64's finalizer, written out from its definition."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _documented_row(raw_id: int, salt: int, rows: int) -> int:
    """The hash as docs/embeddings-raw-ids.md defines it, in plain Python integers."""
    key = _mix((salt + 0x9E3779B97F4A7C15) & MASK)
    return _mix((raw_id & MASK) ^ key) % rows


def test_hash_rows_are_pinned_for_some_ids_and_salts() -> None:
    for salt, rows in PINNED.items():
        assert hashed_rows(torch.tensor(IDS), salt, 1000).tolist() == rows, f"salt {salt}"


def test_hash_is_the_documented_formula_for_any_int64() -> None:
    ids = torch.randint(-(2**63), 2**63 - 1, (500,), generator=torch.Generator().manual_seed(3))
    for salt, rows in ((0, 1), (1, 13), (2**63 + 5, 10**6 + 3), (12345, 2**40 + 1)):
        got = hashed_rows(ids, salt, rows).tolist()
        assert got == [_documented_row(i, salt, rows) for i in ids.tolist()], (salt, rows)


def test_hashed_table_equals_a_plain_table_fed_the_hashed_rows() -> None:
    hashed = EmbeddingBagConfig("t", 13, 4, raw_ids=mp.HashIds(salt=9))
    plain = EmbeddingBagConfig("t", 13, 4)
    bags = [[-5, 2**62, 7], [], [RAW_POOL[0].item(), 7]]
    rows = [[_documented_row(i, 9, 13) for i in bag] for bag in bags]
    got = EmbeddingBagCollection([hashed], seed=1)(SparseFeatures.from_dict({"t": bags}))
    expected = EmbeddingBagCollection([plain], seed=1)(SparseFeatures.from_dict({"t": rows}))
    assert torch.equal(got.values, expected.values)
    seq_got = EmbeddingCollection([EmbeddingConfig("t", 13, 4, raw_ids=mp.HashIds(salt=9))])(
        SparseFeatures.from_dict({"t": bags})
    )
    seq_expected = EmbeddingCollection([EmbeddingConfig("t", 13, 4)])(
        SparseFeatures.from_dict({"t": rows})
    )
    assert torch.equal(seq_got["t"].values, seq_expected["t"].values)


def test_raw_ids_on_a_table_without_raw_ids_say_how_to_map_them() -> None:
    ebc = EmbeddingBagCollection(HASHED_TABLES)
    batch = {f: [[]] for t in HASHED_TABLES for f in t.feature_names}
    with pytest.raises(EmbeddingInputError) as error:
        ebc(SparseFeatures.from_dict({**batch, "plain": [[10**12]]}))
    assert str(error.value) == (
        "feature 'plain' (table 'plain', 11 rows): id 1000000000000 at position 0 of the "
        "feature's ids (sample 0) is out of range; ids must be in [0, 11). If these are raw "
        "ids, set EmbeddingBagConfig(raw_ids=HashIds(...)) or raw_ids=ManagedCollisions(...) "
        "on the table; otherwise hash or clamp them first"
    )


@pytest.mark.parametrize("tables", [HASHED_TABLES, MANAGED_TABLES], ids=["hashed", "managed"])
def test_sharded_world_size_1_trains_like_the_reference(tables: tuple) -> None:
    check_against_reference([train_sharded(tables, [6])], tables, [6])


def test_sharded_sequence_collection_maps_raw_ids_like_the_unsharded_one() -> None:
    tables = [
        EmbeddingConfig("h", 7, 3, raw_ids=mp.HashIds(salt=4)),
        EmbeddingConfig("m", 6, 2, raw_ids=mp.ManagedCollisions(bucket_rows=2)),
    ]
    batches = [
        SparseFeatures.from_dict({"h": [[-1, 2**40], []], "m": [[5, -5, 5], [2**62]]}),
        SparseFeatures.from_dict({"h": [[3]], "m": [[7, 8, 9, 10]]}),
    ]
    unsharded = EmbeddingCollection(tables, seed=2)
    strategy = mp.ManualParallelStrategy()
    emb = mp.shard_embeddings(EmbeddingCollection(tables, seed=2), strategy, rule=SGD(lr=0.1))
    for batch in batches:
        got, expected = emb(batch), unsharded(batch)
        for key in ("h", "m"):
            assert torch.equal(got[key].values, expected[key].values), key


def _sharded(raw_ids: mp.RawIds, seed: int) -> torch.nn.Module:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", 64, 4, raw_ids=raw_ids)], seed=seed)
    return mp.shard_embeddings(ebc, mp.ManualParallelStrategy(), "auto", SGD(lr=0.1))


def _rows(emb: torch.nn.Module) -> torch.Tensor:
    with full_tensors():
        return emb.state_dict()["tables.t.weight"].clone()


# (saved, loaded): settings under which a raw id's row stands for other ids
OTHER_SETTINGS = {
    "hash_salt": (mp.HashIds(salt=0), mp.HashIds(salt=1)),
    "managed_salt": (
        mp.ManagedCollisions(bucket_rows=8),
        mp.ManagedCollisions(salt=1, bucket_rows=8),
    ),
    "bucket_rows": (mp.ManagedCollisions(bucket_rows=8), mp.ManagedCollisions(bucket_rows=16)),
    "hash_to_managed": (mp.HashIds(), mp.ManagedCollisions(bucket_rows=8)),
}


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
@pytest.mark.parametrize("case", sorted(OTHER_SETTINGS))
def test_a_raw_id_checkpoint_refuses_another_raw_id_setting(
    tmp_path: Path, case: str, full: bool
) -> None:
    saved, now = OTHER_SETTINGS[case]
    strategy = mp.ManualParallelStrategy()
    path = strategy.save_checkpoint(tmp_path / "ckpt", {"model": _sharded(saved, 1)}, full=full)
    target = _sharded(now, 2)
    before = _rows(target)
    with pytest.raises(CheckpointMismatchError) as error:
        strategy.load_checkpoint(path, {"model": target})
    assert str(error.value) == (
        f"checkpoint {path}, 'model': the tables were saved with other settings, so their rows "
        f"would mean other ids: table 't': raw_ids={saved!r} in the checkpoint, "
        f"raw_ids={now!r} now. Build the tables with the checkpoint's settings to load it, or "
        "start from fresh tables (another checkpoint directory) to train with the new ones"
    )
    assert torch.equal(_rows(target), before)  # refused before anything was loaded


def test_a_raw_id_checkpoint_loads_under_another_policy_and_without_records(
    tmp_path: Path,
) -> None:
    strategy = mp.ManualParallelStrategy()
    source = _sharded(mp.ManagedCollisions(bucket_rows=8), 1)
    path = strategy.save_checkpoint(tmp_path / "ckpt", {"model": source})
    manifest = json.loads((path / "manualpar.json").read_text())
    assert manifest["records"]["model"] == {
        "tables": {
            "t": {
                "rows": 64,
                "dim": 4,
                "dtype": "fp32",
                "raw_ids": {"kind": "managed", "policy": "lru", "salt": 0, "bucket_rows": 8},
            }
        }
    }
    lfu = _sharded(mp.ManagedCollisions(policy="lfu", bucket_rows=8), 2)
    strategy.load_checkpoint(path, {"model": lfu})  # the policy only picks whom to evict next
    assert torch.equal(_rows(lfu), _rows(source))
    del manifest["records"]  # as written before checkpoints had records: nothing to compare
    (path / "manualpar.json").write_text(json.dumps(manifest))
    other_salt = _sharded(mp.ManagedCollisions(salt=1, bucket_rows=8), 2)
    strategy.load_checkpoint(path, {"model": other_salt})
    assert torch.equal(_rows(other_salt), _rows(source))
