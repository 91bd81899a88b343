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


def _newest(file: RowFile, cache: RowCache, log: WriteLog, rows: torch.Tensor) -> torch.Tensor:
    """The records of `rows` where their `slot_of` says they are (a place or the log)."""
    log.settle()
    log.writes.settle()
    codes = cache.slot_of[rows].to(torch.int64)
    assert bool((codes <= LOGGED).logical_or(codes == STORED).all())
    at = torch.where(codes == STORED, rows, file.rows + LOGGED - codes)
    out = file.empty(rows.numel())
    file.read(at, out)
    return out


def test_a_half_full_log_is_drained_in_the_background_and_wraps(tmp_path: Path) -> None:
    """Once half the log is in use, its records are drained to their places on a thread while
    rows go on being appended after them; a row appended again meanwhile keeps its newer
    record; the drained records are then reused from the log's start."""
    file = RowFile(tmp_path / "t.rows", ROWS, 4, torch.float32, {}, "t", 1, LOG)
    cache = RowCache(ROWS, 10)
    log = WriteLog(file, cache, BackgroundWrites(file), chunk_rows=64)
    expected = _records(file, ROWS, 0)
    file.write_range(0, expected)
    cache.mark_stored()
    first = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1))[:320].sort().values
    expected[first] = _records(file, 320, 1)
    assert log.append(first, expected[first].clone())
    log.step()  # 320 of 600 records in use: the epoch of records 0..319 begins, a piece is out
    assert log.background.epoch == (0, 320) and log.background.piece is not None
    again = first[::4]  # appended again while the piece may be writing them to their places
    expected[again] = _records(file, again.numel(), 2)
    assert log.append(again, expected[again].clone())
    assert (log.head, log.used) == (400, 400)
    log.settle()
    log.step()  # every chunk handed out: the epoch ends, its records free
    assert (log.drains, log.drained, log.background.in_step) == (1, 240, 0)
    assert (log.tail, log.head, log.used) == (320, 400, 80)
    drained = torch.ones(320, dtype=torch.bool)
    drained[::4] = False
    assert (cache.slot_of[first[drained]] == STORED).all()
    assert cache.slot_of[again].tolist() == [LOGGED - k for k in range(320, 400)]
    third = torch.arange(4000, 4250)  # 250 > the 200 left at the end: from the start
    expected[third] = _records(file, 250, 3)
    assert log.append(third, expected[third].clone())
    assert (log.head, log.used) == (250, 80 + 200 + 250)
    assert cache.slot_of[third].tolist() == [LOGGED - k for k in range(250)]
    every = torch.arange(ROWS)
    assert torch.equal(_newest(file, cache, log, every), expected)
    log.drain("a test")
    assert (log.tail, log.head, log.used) == (0, 0, 0)
    assert torch.equal(file.read_range(0, ROWS), expected)


class HeldWrites(BackgroundWrites):
    """Background writes that take their time: a batch reaches the file only when waited for
    (or when the next one is handed over)."""

    def submit(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        self.settle()
        self.held = (rows, records)

    def settle(self) -> None:
        held, self.held = getattr(self, "held", None), None
        if held is not None:
            self.file.write(*held)

    @property
    def in_place(self) -> bool:
        held = getattr(self, "held", None)
        return held is not None and bool(held[0][0] < self.file.rows)


def test_a_log_full_before_its_background_drain_ends_finishes_it_in_the_step(
    tmp_path: Path,
) -> None:
    """An append that finds no room while the epoch is still running drains its rest in the
    training thread, then takes the records it freed; with no epoch to finish, the whole log
    is drained."""
    file = RowFile(tmp_path / "t.rows", ROWS, 4, torch.float32, {}, "t", 1, LOG)
    cache = RowCache(ROWS, 10)
    log = WriteLog(file, cache, HeldWrites(file), chunk_rows=64)
    expected = file.empty(ROWS).zero_()  # the reserved file reads as zeros
    cache.mark_stored()
    # the epoch's first chunk holds rows of the batch still on its way when the epoch begins
    batches = [torch.arange(1000, 3000, 10), torch.arange(0, 150), torch.arange(4000, 4300)]
    for seed, rows in enumerate(batches[:2]):
        expected[rows] = _records(file, rows.numel(), seed)
        assert log.append(rows, expected[rows].clone())
    log.steps = 10**6  # rows come slowly: a chunk a step is pace enough
    log.step()  # the epoch of 350 records begins, one chunk handed out
    log.settle()  # written; the rest waits for steps that do not come
    assert log.background.epoch == (0, 350) and log.background.next_row == 64
    expected[batches[2]] = _records(file, 300, 2)
    assert log.append(batches[2], expected[batches[2]].clone())  # 350 + 300 > 600
    assert (log.drains, log.drained, log.background.in_step) == (1, 350, 78)
    assert (log.tail, log.head, log.used) == (0, 300, 300)
    assert torch.equal(_newest(file, cache, log, torch.arange(ROWS)), expected)
    fourth = torch.arange(100, 500)  # no epoch runs, no room: the whole log drained first
    expected[fourth] = _records(file, 400, 4)
    assert log.append(fourth, expected[fourth].clone())
    assert (log.drains, log.tail, log.head, log.used) == (2, 0, 400, 400)
    assert torch.equal(_newest(file, cache, log, torch.arange(ROWS)), expected)
    assert not log.append(torch.arange(2000, 2601), _records(file, 601, 5))  # more than it holds
    assert log.head == 400  # left to the caller, which writes them to their places
