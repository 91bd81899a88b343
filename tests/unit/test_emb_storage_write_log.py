"""WriteLog alone: appended rows are found in the log by their `slot_of` codes, the newest
record of a row wins, and a drain (whole chunks where logged rows are dense, single records
elsewhere) leaves the file as writing every row to its place would have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from manualpar.embeddings.storage import write_log
from manualpar.embeddings.storage.background_writes import BackgroundWrites
from manualpar.embeddings.storage.row_cache import LOGGED, STORED, RowCache
from manualpar.embeddings.storage.row_file import RowFile
from manualpar.embeddings.storage.write_log import WriteLog

ROWS, LOG = 5000, 600


def _records(file: RowFile, count: int, seed: int) -> torch.Tensor:
    records = file.empty(count)
    records.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return records


@pytest.mark.parametrize("native", [True, False])
def test_a_drain_leaves_the_file_as_writes_in_place_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.setattr(write_log, "DENSE_SHARE", 4)  # a 64-row chunk with 16 logged: dense
    if not native:
        from manualpar.embeddings.storage import background_writes, row_file

        for module in (row_file, background_writes):
            monkeypatch.setattr(module, "native_kernels_take", lambda *tensors: False)
    file = RowFile(tmp_path / "t.rows", ROWS, 6, torch.float16, {"sum": True}, "t", 1, LOG)
    cache = RowCache(ROWS, 10)
    log = WriteLog(file, cache, BackgroundWrites(file), chunk_rows=64)
    expected = _records(file, ROWS, 0)
    file.write_range(0, expected)
    cache.mark_stored()
    generator = torch.Generator().manual_seed(1)
    batches = [
        torch.arange(64, 128, 2),  # 32 rows of one chunk: rewritten whole
        torch.randperm(ROWS, generator=generator)[:300].sort().values,  # scattered
        torch.arange(70, 90),  # newer records of rows logged before: these win
    ]
    for seed, rows in enumerate(batches):
        records = _records(file, rows.numel(), 10 + seed)
        assert log.append(rows, records)
        expected[rows] = records
    logged, at = cache.logged_rows()
    assert log.head == 352 and logged.numel() == torch.cat(batches).unique().numel()
    assert cache.slot_of[75] == LOGGED - (332 + 5)  # the third batch's record of row 75
    got = file.empty(logged.numel())
    log.writes.read(file.rows + at, got)  # the log's records, the last batch maybe in flight
    assert torch.equal(got, expected[logged])
    log.drain("a test")
    assert (log.head, log.drains, log.drained) == (0, 1, logged.numel())
    assert (cache.slot_of == STORED).all()
    assert torch.equal(file.read_range(0, ROWS), expected)


def test_a_full_log_is_drained_before_the_batch_that_does_not_fit(tmp_path: Path) -> None:
    file = RowFile(tmp_path / "t.rows", ROWS, 4, torch.float32, {}, "t", 1, LOG)
    cache = RowCache(ROWS, 10)
    log = WriteLog(file, cache, BackgroundWrites(file), chunk_rows=256)
    first, second = torch.arange(0, 500), torch.arange(1000, 1200)
    assert log.append(first, _records(file, 500, 1))
    assert log.append(second, _records(file, 200, 2))  # 700 > 600 records: drained first
    assert (log.drains, log.head) == (1, 200)
    assert (cache.slot_of[first] == STORED).all()
    assert cache.slot_of[second].tolist() == [LOGGED - k for k in range(200)]
    assert not log.append(torch.arange(2000, 2601), _records(file, 601, 3))  # more than it holds
    assert log.head == 200  # left to the caller, which writes them to their places
