"""A row file cut short while the disk tier holds it (reliability row 73), at the moments that
used to slip past the read check: right after a checkpoint, when the write log is empty and a
flush's write-back regrows the file with a hole that reads as zeros, and a checkpoint reading the
file's map, which met the cut with SIGBUS. Also a background save whose copy of a disk table
finds no room beside it."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
from pathlib import Path
from typing import Any

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
from manualpar.errors import CheckpointError, StorageError

ROWS = 2000
TABLES = (EmbeddingBagConfig("big", ROWS, 4),)
CUT = (
    r"disk tier: table 'big' \(rank 0\): cannot {doing} '.*big\.rows0\.cols0\.rank0\.rows': the "
    r"file has 100 bytes, 40\.3 KiB were reserved for 2000 rows and 64 write-log records; it "
    r"was truncated or replaced while this tier held it\. Its rows are lost: restart from the "
    r"last checkpoint"
)


def _trained(directory: Path, strategy: mp.ManualParallelStrategy) -> Any:
    with mp.empty_init():  # rows generated on first use: the file starts unwritten
        ebc = EmbeddingBagCollection(TABLES, seed=1)
    plan = EmbeddingPlan(1, {"big": row_wise(on_disk=True)})
    tier = DiskTier(directory, cache_rows=16, write_log=4.0)
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.1), disk_tier=tier)
    for step in range(3):
        _step(emb, step)
    return emb


def _step(emb: Any, step: int, low: int = 0) -> None:
    """A step on 12 ids drawn from rows [low, low + ROWS // 2)."""
    ids = low + torch.randint(0, ROWS // 2, (12,), generator=torch.Generator().manual_seed(step))
    _train_on(emb, ids)


def _train_on(emb: Any, ids: torch.Tensor) -> None:
    emb(SparseFeatures(["big"], ids, torch.tensor([ids.numel()]))).values.square().sum().backward()


def _save(strategy: mp.ManualParallelStrategy, path: Path, emb: Any, background: bool) -> None:
    state = {"emb": emb, "opt": emb.fused_optimizer}
    if background:
        strategy.save_checkpoint_async(path, state).wait()
    else:
        strategy.save_checkpoint(path, state)


@pytest.mark.parametrize("dirty", [True, False], ids=["dirty-rows", "right-after-a-checkpoint"])
@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_a_file_cut_after_a_checkpoint_is_never_checkpointed(
    tmp_path: Path, background: bool, dirty: bool
) -> None:
    """Cut while the write log is empty (just after a checkpoint): the next save used to write
    the dirty rows back into a regrown file and commit its hole as zero rows (dirty), or die of
    SIGBUS reading the map (clean). Now it raises, and the first checkpoint stays the latest."""
    strategy = mp.ManualParallelStrategy()
    emb = _trained(tmp_path / "tier", strategy)
    _save(strategy, tmp_path / "first", emb, background)
    if dirty:  # cached rows to write back, the last one among them: that regrew the whole
        _train_on(emb, torch.tensor([5, 700, ROWS - 1]))  # file, its hole then saved as zeros
    (path,) = (tmp_path / "tier").glob("*.rows")
    os.truncate(path, 100)  # another process cut it
    with pytest.raises(StorageError) as cut:
        _save(strategy, tmp_path / "second", emb, background)
    assert re.match(CUT.format(doing=r"write rows back to"), str(cut.value)), str(cut.value)
    assert mp.latest_checkpoint(tmp_path) == tmp_path / "first"
    assert not (tmp_path / "second").exists()


def test_a_step_after_a_cut_raises_before_it_writes(tmp_path: Path) -> None:
    """A cut mid-training, then a step on rows never written (nothing read back to fail short):
    its evicted rows, appended to the write log at the file's end, regrew the file over a hole,
    and the rows logged or stored before the cut read back as zeros. The step names the cut."""
    emb = _trained(tmp_path, mp.ManualParallelStrategy())
    (path,) = tmp_path.glob("*.rows")
    emb.storage.by_name["big"].write_back.settle()  # nothing lands after the cut
    os.truncate(path, 100)
    with pytest.raises(StorageError, match=CUT.format(doing="look up rows in")):
        _step(emb, 3, low=ROWS // 2)  # rows the first steps never touched


def test_a_checkpoint_chunk_of_a_cut_file_raises_instead_of_sigbus(tmp_path: Path) -> None:
    """The checkpoint reads (and a load writes) the file's map a chunk at a time, each after its
    block's `prepare`: a file cut after the flush is named there, not met as SIGBUS."""
    emb = _trained(tmp_path, mp.ManualParallelStrategy())
    store = emb.storage.by_name["big"]
    chunks = store.checkpoint_chunks(None)  # flushed: the file is whole
    (path,) = tmp_path.glob("*.rows")
    os.truncate(path, 100)
    with pytest.raises(StorageError, match=CUT.format(doing="map rows of")):
        store.drop_pages()  # what a checkpoint calls before it reads each chunk
    del chunks


def test_a_background_save_without_room_for_its_copy_names_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background save copies a disk table into a file beside it; on a full file system the
    copy's map met SIGBUS. Free space is checked first: a CheckpointError naming the bytes."""
    strategy = mp.ManualParallelStrategy()
    emb = _trained(tmp_path / "tier", strategy)
    _save(strategy, tmp_path / "first", emb, background=False)
    usage = shutil.disk_usage

    def full_beside_the_tier(path: str | os.PathLike[str]) -> Any:
        free = 1000 if Path(path) == tmp_path / "tier" else usage(path).free
        return usage(path)._replace(free=free)

    monkeypatch.setattr(shutil, "disk_usage", full_beside_the_tier)
    with pytest.raises(CheckpointError) as refused:
        _save(strategy, tmp_path / "second", emb, background=True)
    message = str(refused.value)
    assert re.fullmatch(
        r"save_checkpoint_async: no room for the copy of this rank's disk tables: a background "
        r"save copies their blocks into '.*tier' \(the disk tier's directory\) until it is "
        r"written, which needs 0\.0 MiB \(40000 bytes\) there, and 0\.0 MiB \(1000 bytes\) "
        r"are free; free disk space there, or save with save_checkpoint \(synchronous: it "
        r"makes no copy\)",
        message,
    ), message
    assert mp.latest_checkpoint(tmp_path) == tmp_path / "first"
    assert not list((tmp_path / "tier").glob(".background-save-*"))


def test_a_background_copy_that_cannot_be_reserved_is_named(tmp_path: Path) -> None:
    """Free space is not the whole story (a quota, a file size limit, another writer filling
    the disk meanwhile): the copy's file is reserved before its map is written, so a refusal
    is named there. Simulated with a file size limit below the copy's bytes."""
    strategy = mp.ManualParallelStrategy()
    emb = _trained(tmp_path / "tier", strategy)
    _save(strategy, tmp_path / "first", emb, background=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail with EFBIG, not the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, hard))
    try:
        with pytest.raises(CheckpointError) as refused:
            _save(strategy, tmp_path / "second", emb, background=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert re.fullmatch(
        r"save_checkpoint_async: no room for the copy of this rank's disk tables: .* which "
        r"needs 0\.0 MiB \(32000 bytes\) there, and reserving it failed \(File too large\); "
        r"free disk space there, or save with save_checkpoint \(synchronous: it makes no copy\)",
        str(refused.value),
    ), str(refused.value)
    assert mp.latest_checkpoint(tmp_path) == tmp_path / "first"
