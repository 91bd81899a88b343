"""A disk-tier file inherited by another process (reliability rows on the tier's files): a
forked child lets go of the tier's files at once, and a lock that outlives the owner record's
process says which process still holds the file. These start processes, so they live here."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
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
    row_wise,
    shard_embeddings,
)
from manualpar.embeddings.storage.file_owner import owner_path
from manualpar.errors import BuilderError

TABLES = (EmbeddingBagConfig("big", 64, 4),)
ON_DISK = EmbeddingPlan(1, {"big": row_wise(on_disk=True)})


def _sharded(tier: DiskTier) -> torch.nn.Module:
    ebc = EmbeddingBagCollection(TABLES, seed=1)
    return shard_embeddings(
        ebc, mp.ManualParallelStrategy(), ON_DISK, RowWiseAdagrad(lr=0.1), disk_tier=tier
    )


def _step(emb: torch.nn.Module, step: int) -> None:
    ids = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(step))
    emb(SparseFeatures(["big"], ids, torch.full((8,), 3))).values.square().sum().backward()


def _path(directory: Path) -> Path:
    return directory / "big.rows0.cols0.rank0.rows"


def test_a_lock_inherited_by_a_forked_child_is_let_go(tmp_path: Path) -> None:
    """A process forked while a tier holds its files (a data-loader worker, say) inherited the
    open file, and with it the lock: after the tier's process ended, the file stayed locked in
    the name of a process that no longer existed. The child now lets go of the tier's files."""
    first = _sharded(DiskTier(tmp_path, cache_rows=32))
    _step(first, 0)
    store = first.storage.by_name["big"]
    del store.checkpoint_chunks(None)[:]  # the checkpoint's map of the file, kept open
    reading, writing = os.pipe()
    ready_reading, ready_writing = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only waits to be told to end
        # fork() returns here once the at-fork handlers ran: say so, then wait
        os.close(writing)
        os.write(ready_writing, b"r")
        os.read(reading, 1)
        os._exit(0)
    os.close(reading)
    os.close(ready_writing)
    # Wait for the child to be past fork(): until then a loaded machine may not have run its
    # at-fork handler, and the lock (the open file's, shared with the child) would still be
    # held through the child's copy, which is what the handler is there to prevent.
    assert os.read(ready_reading, 1) == b"r"
    os.close(ready_reading)
    try:
        store.file.close()  # as when the first tier's process ends: its own hold goes
        again = _sharded(DiskTier(tmp_path, cache_rows=32))  # the child holds nothing
        _step(again, 0)
    finally:
        os.close(writing)
        os.waitpid(child, 0)


def test_a_file_locked_by_another_than_its_named_holder_says_so(tmp_path: Path) -> None:
    """The owner record names a process that has exited, yet the file is locked: a process it
    started inherited the file. The message says so and names the processes holding it open."""
    path = _path(tmp_path)
    first = _sharded(DiskTier(tmp_path, cache_rows=32))
    first.storage.by_name["big"].file.close()
    holder = os.open(path, os.O_RDONLY)  # locked as by a child that inherited the file
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        gone = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        record = json.loads(owner_path(path).read_text())
        owner_path(path).write_text(json.dumps({**record, "pid": int(gone.stdout)}))
        with pytest.raises(BuilderError) as refused:
            _sharded(DiskTier(tmp_path, cache_rows=32))
    finally:
        os.close(holder)
    message = str(refused.value)
    assert (
        f"process {int(gone.stdout)}, named in its owner record, has exited, but the file is "
        f"still locked: a process it started inherited the file (open in process {os.getpid()})"
    ) in message, message
    assert "Stop that process (it may still write the file)" in message
