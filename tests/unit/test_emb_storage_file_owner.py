"""One owner per disk-tier file, and the tier's edges (reliability rows 71-73): a second tier
on the same directory is refused before it touches the first one's rows, which then train on
exactly as if alone; a cache smaller than one row and a row file cut short are named; no link
is followed and the files stay private. A forked child and the lock it inherits:
tests/e2e/test_disk_tier_inherited_lock.py."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
from pathlib import Path

import pytest
import torch

import manualpar as mp
from manualpar import full_tensors
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
)
from manualpar.embeddings.storage.file_owner import owner_path
from manualpar.errors import BuilderError, CheckpointError, StorageError

TABLES = (EmbeddingBagConfig("big", 64, 4),)
ON_DISK = EmbeddingPlan(1, {"big": row_wise(on_disk=True)})


def _sharded(tier: DiskTier | None) -> torch.nn.Module:
    plan = ON_DISK if tier is not None else EmbeddingPlan(1, {"big": row_wise()})
    ebc = EmbeddingBagCollection(TABLES, seed=1)
    return shard_embeddings(
        ebc, mp.ManualParallelStrategy(), plan, RowWiseAdagrad(lr=0.1), disk_tier=tier
    )


def _step(emb: torch.nn.Module, step: int) -> None:
    ids = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(step))
    emb(SparseFeatures(["big"], ids, torch.full((8,), 3))).values.square().sum().backward()


def _table(emb: torch.nn.Module) -> torch.Tensor:
    with full_tensors():
        return emb.state_dict()["tables.big.weight"].clone()


def test_a_second_tier_on_the_same_directory_is_refused_and_the_first_trains_on(
    tmp_path: Path,
) -> None:
    first = _sharded(DiskTier(tmp_path, cache_rows=32))
    reference = _sharded(None)  # the same table in memory: what the first must keep equal
    for step in range(3):
        _step(first, step)
        _step(reference, step)
    with pytest.raises(BuilderError) as refused:
        _sharded(DiskTier(tmp_path, cache_rows=32))  # e.g. two collections with one table name
    message = str(refused.value)
    assert re.search(
        r"the table 'big' \(rank 0\) file '.*big\.rows0\.cols0\.rank0\.rows' is in "
        r"use by another disk tier \(process \d+ \(this process\) on ",
        message,
    )
    assert (
        f"on {socket.gethostname()}, holding table 'big' (rank 0): 64 rows x 4 float32" in message
    )
    assert "own DiskTier(directory=...)" in message
    for step in range(3, 8):  # nothing was truncated: the first tier trains on, bit for bit
        _step(first, step)
        _step(reference, step)
    assert torch.equal(_table(first), _table(reference))


def test_the_row_file_says_what_it_holds_and_who_holds_it(tmp_path: Path) -> None:
    _sharded(DiskTier(tmp_path, cache_rows=32))
    (record,) = tmp_path.glob("*.owner.json")
    owner = json.loads(record.read_text())
    assert record.name == "big.rows0.cols0.rank0.rows.owner.json"
    assert owner["holds"] == (
        "table 'big' (rank 0): 64 rows x 4 float32, state ['sum'], 20 bytes a row, "
        "64 write-log records"
    )
    assert (owner["pid"], owner["host"]) == (os.getpid(), socket.gethostname())


def test_a_file_left_by_a_closed_tier_is_taken_over(tmp_path: Path) -> None:
    first = _sharded(DiskTier(tmp_path, cache_rows=32))
    _step(first, 0)
    for table in first.storage.stores.values():
        table.file.close()  # as when its process exits: the lock goes with it
    again = _sharded(DiskTier(tmp_path, cache_rows=32))
    _step(again, 0)
    reference = _sharded(None)
    _step(reference, 0)
    assert torch.equal(_table(again), _table(reference))


def test_a_cache_smaller_than_one_row_is_refused_when_built(tmp_path: Path) -> None:
    with pytest.raises(
        BuilderError,
        match=re.escape(
            "DiskTier(cache_bytes=1) cannot hold one row of each disk table on this rank "
            "(20 bytes: big: 20 B, weights and optimizer state)"
        ),
    ):
        _sharded(DiskTier(tmp_path, cache_bytes=1))


def test_a_row_file_cut_short_is_named(tmp_path: Path) -> None:
    emb = _sharded(DiskTier(tmp_path, cache_rows=30))
    for step in range(4):  # rows evicted to the file
        _step(emb, step)
    (path,) = tmp_path.glob("*.rows")
    store = emb.storage.by_name["big"]
    # the last eviction's rows may still be on their way: a write landing after the cut
    # would grow the file back (the race this test once lost)
    store.write_back.settle()
    os.truncate(path, 100)  # another process cut it
    rows = store.file
    with pytest.raises(StorageError) as cut:
        rows.read(torch.tensor([63]), rows.empty(1))  # as a step fetching row 63 does
    assert re.search(
        r"disk tier: table 'big' \(rank 0\): cannot read row 63 from '.*big\.rows0\.cols0\."
        r"rank0\.rows': the file has 100 bytes, 2.5 KiB were reserved for 64 rows and 64 "
        r"write-log records; it was "
        r"truncated or replaced while this tier held it",
        str(cut.value),
    ), str(cut.value)
    assert isinstance(cut.value, mp.ManualParError)
    assert str(cut.value).startswith("disk tier: ")  # no errno prefix
    with pytest.raises(StorageError, match=re.escape("cannot read rows 0..63 from")):
        rows.read_range(0, 64)  # as a checkpoint reading the block does


def test_a_load_while_rows_are_pinned_is_refused(tmp_path: Path) -> None:
    """Between a forward and its backward the step's rows are pinned in the cache; a load then
    would leave that step on its slots' old values: refused, naming the fix."""
    emb = _sharded(DiskTier(tmp_path, cache_rows=32))
    _step(emb, 0)
    with full_tensors():  # plain tensors, copied (the cache's are views)
        state = {k: v.clone() for k, v in emb.state_dict().items()}
    pooled = emb(SparseFeatures(["big"], torch.tensor([1, 2, 3]), torch.tensor([3])))
    with pytest.raises(CheckpointError) as refused:
        emb.load_state_dict(state)
    assert str(refused.value) == (
        "disk tier: table 'big' (rank 0): a checkpoint was loaded while 3 cached rows are "
        "pinned by a batch in flight (read ahead by a pipeline, or a forward whose backward has "
        "not run), which would then use their old values; drop the batches in flight first "
        "(emb.drop_prefetched()) and load between steps"
    )
    pooled.values.sum().backward()  # the step ends; its rows are released
    emb.load_state_dict(state)
    assert torch.equal(_table(emb), state["tables.big.weight"])


def _path(directory: Path) -> Path:
    return directory / "big.rows0.cols0.rank0.rows"


def test_a_link_named_like_a_row_file_is_refused_and_its_target_kept(tmp_path: Path) -> None:
    """The tier empties its files when it opens them: through a symbolic link that emptied
    whatever the link pointed to. Links (and anything but a plain file) are refused."""
    precious = tmp_path / "precious"
    precious.write_bytes(b"not rows")
    (tmp_path / "tier").mkdir()
    _path(tmp_path / "tier").symlink_to(precious)
    with pytest.raises(StorageError) as refused:
        _sharded(DiskTier(tmp_path / "tier", cache_rows=32))
    assert re.fullmatch(
        r"disk tier: the table 'big' \(rank 0\) file '.*big\.rows0\.cols0\.rank0\.rows' is a "
        r"symbolic link; the tier empties its files when it opens them and does not follow "
        r"links: remove it, or give DiskTier\(directory=\.\.\.\) a directory of its own",
        str(refused.value),
    ), str(refused.value)
    assert precious.read_bytes() == b"not rows"
    assert not (tmp_path / "tier" / "big.rows0.cols0.rank0.rows.owner.json").exists()


def test_owner_records_follow_no_link_and_files_stay_private(tmp_path: Path) -> None:
    """A link at the owner record's scratch name used to be written through (its target
    overwritten); a leftover row file kept its mode, and the owner record took the umask's."""
    precious = tmp_path / "precious"
    precious.write_bytes(b"not an owner record")
    (tmp_path / "tier").mkdir()
    path = _path(tmp_path / "tier")
    record = owner_path(path)
    record.with_name(record.name + ".partial").symlink_to(precious)
    path.write_bytes(b"left by an earlier job")
    path.chmod(0o666)
    old_umask = os.umask(0)
    try:
        _sharded(DiskTier(tmp_path / "tier", cache_rows=32))
    finally:
        os.umask(old_umask)
    assert precious.read_bytes() == b"not an owner record"
    assert json.loads(record.read_text())["pid"] == os.getpid()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # rows and optimizer state: private
    assert stat.S_IMODE(record.stat().st_mode) == 0o600


def test_an_owner_record_that_is_a_directory_is_named(tmp_path: Path) -> None:
    owner_path(_path(tmp_path)).mkdir(parents=True)
    with pytest.raises(StorageError) as refused:
        _sharded(DiskTier(tmp_path, cache_rows=32))
    assert re.fullmatch(
        r"disk tier: cannot write the owner record '.*big\.rows0\.cols0\.rank0\.rows\.owner\."
        r"json' of the table 'big' \(rank 0\) file: Is a directory; remove it \(the tier "
        r"writes there what the file holds and who holds it\), or give "
        r"DiskTier\(directory=\.\.\.\) a directory of its own",
        str(refused.value),
    ), str(refused.value)
