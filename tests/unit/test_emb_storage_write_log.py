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
    monkeypatch.setattr(write_log, "SCAN_ROWS", 700)  # the block looked at in 8 ranges
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


def test_a_full_log_is_drained_keeping_its_last_quarter(tmp_path: Path) -> None:
    """A batch that does not fit drains the log first; the rows of its last quarter stay
    logged, moved to its start, and every row still reads its newest values."""
    file = RowFile(tmp_path / "t.rows", ROWS, 4, torch.float32, {}, "t", 1, LOG)
    cache = RowCache(ROWS, 10)
    log = WriteLog(file, cache, BackgroundWrites(file), chunk_rows=64)
    first, second = torch.arange(0, 500), torch.arange(1000, 1200)
    values = {1: _records(file, 500, 1), 2: _records(file, 200, 2)}
    assert log.append(first, values[1])
    assert log.append(second, values[2])  # 700 > 600 records: drained first
    assert (log.drains, log.drained, log.head) == (1, 350, 150 + 200)
    assert (cache.slot_of[first[:350]] == STORED).all()
    assert cache.slot_of[first[350:]].tolist() == [LOGGED - k for k in range(150)]
    assert cache.slot_of[second].tolist() == [LOGGED - k for k in range(150, 350)]
    log.writes.settle()
    assert torch.equal(file.read_range(0, 350), values[1][:350])  # at their places
    assert torch.equal(file.read_range(ROWS, ROWS + 350), torch.cat([values[1][350:], values[2]]))
    assert not log.append(torch.arange(2000, 2601), _records(file, 601, 3))  # more than it holds
    assert log.head == 350  # left to the caller, which writes them to their places
    assert log.append(torch.arange(3000, 3400), _records(file, 400, 4))  # drained, kept 150
    assert (log.drains, log.head) == (2, 150 + 400)
    assert cache.logged_rows()[0].tolist() == [*range(1050, 1200), *range(3000, 3400)]
    assert torch.equal(file.read_range(350, 500), values[1][350:])  # drained this time
    assert log.append(torch.arange(4000, 4500), _records(file, 500, 5))
    assert (log.drains, log.head) == (4, 500)  # 150 kept + 500 > 600: drained again, whole
    assert cache.logged_rows()[0].tolist() == list(range(4000, 4500))
