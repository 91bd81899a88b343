"""One owner per disk-tier file, and the tier's edges (reliability rows 71-73): a second tier
on the same directory is refused before it touches the first one's rows, which then train on
exactly as if alone; a cache smaller than one row and a row file cut short are named."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch

import manualpar as mp
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    full_tensors,
    on_disk,
    row_wise,
    shard_embeddings,
)
from manualpar.errors import BuilderError, CheckpointError, StorageError

TABLES = (EmbeddingBagConfig("big", 64, 4),)
ON_DISK = EmbeddingPlan(1, {"big": on_disk(row_wise())})


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
