"""A checkpoint load writes a disk table's rows with pwrite, never through the file's map (whose
first write of each page cost 5-12x): bit-exact rows, and no row cached before the load served
afterwards, through every load path (DCP's reads, a narrowing dtype's checked copies, a full
export)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors, loading
from manualpar.embeddings import (
    Adagrad,
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
)
from manualpar.embeddings.storage.disk_tier import DiskTable

ROWS, DIM = 4096, 16  # 256 KiB of weights: DCP's items are read straight (direct.py)


def _collection(
    directory: Path | None, dtype: torch.dtype = torch.float32, rule: Any = None
) -> Any:
    """The table on disk (in `directory`, 256 cached rows) or in memory (None)."""
    with mp.empty_init():
        ebc = EmbeddingBagCollection([EmbeddingBagConfig("big", ROWS, DIM, dtype=dtype)], seed=3)
    placement = row_wise(on_disk=directory is not None)
    tier = DiskTier(directory, cache_rows=256) if directory is not None else None
    return shard_embeddings(
        ebc,
        mp.ManualParallelStrategy(),
        EmbeddingPlan(1, {"big": placement}),
        rule or RowWiseAdagrad(lr=0.5),
        disk_tier=tier,
    )


def _features(step: int) -> SparseFeatures:
    ids = torch.randint(0, ROWS, (48,), generator=torch.Generator().manual_seed(step))
    return SparseFeatures(["big"], ids, torch.full((16,), 3))


def _train(emb: Any, steps: range) -> None:
    for step in steps:
        (emb(_features(step)).values - 0.5).square().sum().backward()


def _snapshot(emb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    with full_tensors():
        weight = emb.state_dict()["tables.big.weight"].clone()
        return weight, emb.fused_optimizer.state_dict()["state"]["big"]["sum"].clone()


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's maps of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The resident KiB of the row file's map as each load ends (before `loaded()` lets go of
    the pages): a load that wrote through the map left its last chunk's pages there."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("needs /proc/self/smaps (Linux)")
    seen: list[int] = []
    original = DiskTable.loaded

    def loaded(self: DiskTable, keys: Any) -> None:
        seen.append(_mapped_kib(self.file.path))
        original(self, keys)

    monkeypatch.setattr(DiskTable, "loaded", loaded)
    return seen


def _load_and_compare(
    strategy: mp.ManualParallelStrategy, path: Path, state: Any, watched: list[int]
) -> None:
    """Load `path` into a disk table that trained other values first (cached, dirty rows) and
    an in-memory one: the same bits, and the same lookups after."""
    disk, memory = _collection(state["dir"], state["dtype"]), _collection(None, state["dtype"])
    _train(disk, range(10, 13))  # rows cached and dirty before the load: must not survive it
    for emb in (disk, memory):
        strategy.load_checkpoint(path, {"model": emb, "sparse": emb.fused_optimizer})
    assert watched and all(kib == 0 for kib in watched), watched
    table = disk.storage.by_name["big"]
    assert table.load_writes.calls > 0
    for on_disk, in_memory in zip(_snapshot(disk), _snapshot(memory), strict=True):
        assert torch.equal(on_disk, in_memory)
    with torch.no_grad():  # lookups of rows cached before the load read the loaded rows
        for step in range(10, 13):
            assert torch.equal(disk(_features(step)).values, memory(_features(step)).values)
    _train(disk, range(20, 22))
    _train(memory, range(20, 22))
    for on_disk, in_memory in zip(_snapshot(disk), _snapshot(memory), strict=True):
        assert torch.equal(on_disk, in_memory)


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full_export"])
def test_a_load_writes_the_file_not_its_map(tmp_path: Path, watched: list[int], full: bool) -> None:
    strategy = mp.ManualParallelStrategy()
    saved = _collection(tmp_path / "saved")
    _train(saved, range(4))
    path = tmp_path / ("ckpt.pt" if full else "ckpt")
    strategy.save_checkpoint(path, {"model": saved, "sparse": saved.fused_optimizer}, full=full)
    state = {"dir": tmp_path / "loaded", "dtype": torch.float32}
    _load_and_compare(strategy, path, state, watched)


def test_a_narrowing_load_writes_its_checked_copies_to_the_file(
    tmp_path: Path, watched: list[int]
) -> None:
    """float32 rows into a float16 table: read and range-checked in copies first, then written
    to the file converted, as an in-memory table converts them."""
    strategy = mp.ManualParallelStrategy()
    saved = _collection(tmp_path / "saved")
    _train(saved, range(4))
    path = tmp_path / "ckpt"
    strategy.save_checkpoint(path, {"model": saved, "sparse": saved.fused_optimizer})
    state = {"dir": tmp_path / "loaded", "dtype": torch.float16}
    _load_and_compare(strategy, path, state, watched)


def test_a_state_dict_load_after_an_abandoned_load_reads_the_rows_it_patches(
    tmp_path: Path,
) -> None:
    """A load that never finished was told which rows were never written (every row here: its
    writes take them as zeros, unread); a plain load_state_dict after it makes the file whole
    first, so its writes read every row: the accumulators stay 0.25, not zeros."""
    rule = Adagrad(lr=0.5, initial_accumulator_value=0.25)
    disk, memory = _collection(tmp_path / "t", rule=rule), _collection(None, rule=rule)
    with loading():
        disk.state_dict()  # handed to a load that then failed before writing
    source = _collection(None)
    _train(source, range(5, 7))
    with full_tensors():
        weights = {k: v.clone() for k, v in source.state_dict().items()}
    for emb in (disk, memory):
        emb.load_state_dict(weights)
    for on_disk, in_memory in zip(_snapshot(disk), _snapshot(memory), strict=True):
        assert torch.equal(on_disk, in_memory)
