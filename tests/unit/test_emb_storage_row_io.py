"""The disk tier's row IO: batches of records through the C++ pread/pwrite loop (one or several
threads) give the bytes the Python loop gives; evicted rows written in the background are read
back new, and a write that fails is raised in the caller's thread naming the file and row."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from manualpar.embeddings import DiskTier
from manualpar.embeddings.kernels.native import native_kernels
from manualpar.embeddings.storage import row_file
from manualpar.embeddings.storage.background_writes import BackgroundWrites
from manualpar.embeddings.storage.row_cache import LOGGED, NEVER, STORED
from manualpar.embeddings.storage.row_file import RowFile
from manualpar.errors import BuilderError, StorageError

needs_kernels = pytest.mark.skipif(
    native_kernels() is None, reason="the C++ kernels could not be built on this machine"
)


def _file(path: Path, threads: int = 1, log_rows: int = 0) -> RowFile:
    return RowFile(
        path, 5000, 6, torch.float16, {"sum": True}, "table 't' (rank 0)", threads, log_rows
    )


def _records(file: RowFile, count: int, seed: int) -> torch.Tensor:
    records = file.empty(count)
    records.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return records


@needs_kernels
@pytest.mark.parametrize("threads", [1, 4])
def test_cpp_batches_move_the_bytes_the_python_loop_moves(tmp_path, monkeypatch, threads):
    cpp, python = _file(tmp_path / "cpp.rows", threads), _file(tmp_path / "py.rows")
    scattered = torch.randperm(4000, generator=torch.Generator().manual_seed(0))[:1200]
    rows = torch.cat([scattered[:600], torch.arange(4200, 4500), scattered[600:]])  # a run
    records = _records(cpp, 1500, 1)
    cpp.write(rows, records)
    got = cpp.empty(1500)
    cpp.read(rows.flip(0), got)
    assert torch.equal(got, records.flip(0))
    monkeypatch.setattr(row_file, "native_kernels_take", lambda *tensors: False)
    python.write(rows, records)
    assert (tmp_path / "cpp.rows").read_bytes() == (tmp_path / "py.rows").read_bytes()


@needs_kernels
def test_a_row_evicted_a_moment_ago_is_read_back_new(tmp_path):
    """Rows of the batch on its way come from its records, the others from the file (written
    by an earlier batch), in the order asked, whether or not the write has finished."""
    file = _file(tmp_path / "t.rows")
    writes = BackgroundWrites(file)
    latest: dict[int, torch.Tensor] = {}
    for round_ in range(20):  # the read may start while the write is still on its way
        rows = torch.arange(round_, 5000, 7)
        records = _records(file, rows.numel(), round_)
        writes.submit(rows, records.clone())
        latest.update({int(r): records[k] for k, r in enumerate(rows)})
        others = [r for r in range(0, 5000, 11) if r in latest and r % 7 != round_ % 7]
        earlier = torch.tensor(others, dtype=torch.int64)
        wanted = torch.cat([rows[::3], earlier]).flip(0)
        got = file.empty(wanted.numel())
        writes.read(wanted, got)
        for k, r in enumerate(wanted.tolist()):
            assert torch.equal(got[k], latest[r]), (round_, r)
    writes.settle()
    got = file.empty(3)
    writes.read(torch.tensor([19, 26, 0]), got)  # nothing in flight: from the file
    assert torch.equal(got, torch.stack([latest[19], latest[26], latest[0]]))


@needs_kernels
def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path):
    file = _file(tmp_path / "t.rows")
    writes = BackgroundWrites(file)
    os.close(file.fd)  # the descriptor is gone: every write fails
    read_only = os.open(tmp_path / "t.rows", os.O_RDONLY)
    file.fd = read_only
    writes.submit(torch.tensor([3, 9]), _records(file, 2, 0))
    with pytest.raises(StorageError, match=re.escape("cannot write row 3 of ") + ".*t.rows"):
        writes.settle()
    writes.settle()  # raised once; nothing is left in flight
    writes.submit(torch.tensor([5002, 5003]), _records(file, 2, 0))  # past the rows: the log
    with pytest.raises(OSError, match=re.escape("cannot write write-log record 2 of ")):
        writes.settle()


@needs_kernels
def test_a_run_of_rows_cut_short_names_the_first_row_missing(tmp_path):
    """Consecutive rows move in one call; a file that ends inside the run names the first row
    it could not read, as the call per row did."""
    file = _file(tmp_path / "t.rows", log_rows=10)
    file.write(torch.arange(5000, 5010), _records(file, 10, 0))
    os.truncate(tmp_path / "t.rows", 5006 * file.record + 3)  # record 6 of the log is cut
    with pytest.raises(StorageError, match=re.escape("cannot read write-log record 6 from ")):
        file.read(torch.arange(5002, 5009), file.empty(7))


def test_io_threads_is_checked():
    with pytest.raises(BuilderError, match=re.escape("io_threads must be a positive int, got 0")):
        DiskTier("x", cache_rows=8, io_threads=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpp_copies_between_records_and_cache_rows_equal_the_torch_ops(
    tmp_path, monkeypatch, dtype
):
    """A fetch's records into cache rows and a write-back's rows into records, the weights and a
    per-row and a per-column state, the same bytes in C++ as with index ops."""
    file = RowFile(tmp_path / "t.rows", 100, 5, dtype, {"sum": True, "moment": False}, "t", 1)
    records = _records(file, 7, 3)
    file.weight_of(records).copy_(torch.randn(7, 5).to(dtype))  # no NaN bit patterns
    for key in ("sum", "moment"):
        state = file.state_of(records, key)
        state.copy_(torch.randn(state.shape))
    slots = torch.tensor([9, 0, 4, 11, 2, 7, 5])
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(row_file, "native_kernels_take", lambda *tensors: False)
        weight = torch.zeros(12, 5, dtype=dtype)
        state = {"sum": torch.zeros(12), "moment": torch.zeros(12, 5)}
        file.to_slots(records, slots, weight, state)
        back = file.empty(7).zero_()
        file.from_slots(back, slots.flip(0), weight, state)
        results.append((weight, state, back))
    (weight, state, back), (weight_ref, state_ref, back_ref) = results
    assert torch.equal(
        weight.view(torch.int16 if dtype != torch.float32 else torch.int32),
        weight_ref.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
    assert all(torch.equal(state[key], state_ref[key]) for key in state)
    assert torch.equal(weight[slots], file.weight_of(records))
    assert torch.equal(back, back_ref)  # padding included
    for key in ("sum", "moment"):  # read back in the reverse order of the slots
        assert torch.equal(file.state_of(back, key), file.state_of(records, key).flip(0))


@needs_kernels
@pytest.mark.parametrize("threads", [1, 4])
def test_a_fetch_reads_each_record_straight_into_its_slot(tmp_path, threads):
    """One C++ call per fetch: rows at their place, in the write log and in the batch being
    written land in their slots' weights and state (padding of an odd bfloat16 row dropped);
    rows never written are handed back, as the read into records and copies did."""
    fields = {"sum": True, "moment": False}
    file = RowFile(tmp_path / "t.rows", 3000, 5, torch.bfloat16, fields, "t", threads, 100)
    records = _records(file, 3100, 0)
    file.weight_of(records).copy_(torch.randn(3100, 5).to(torch.bfloat16))  # no NaN bits
    file.write(torch.arange(3100), records)
    writes = BackgroundWrites(file)
    in_flight = torch.tensor([7, 40, 3021])  # rows 7 and 40 at their place, log record 21
    newer = _records(file, 3, 1)
    file.weight_of(newer).copy_(torch.randn(3, 5).to(torch.bfloat16))
    writes.submit(in_flight, newer.clone())
    latest = records.clone()
    latest[in_flight] = newer
    rows = torch.randperm(3000, generator=torch.Generator().manual_seed(2))[:1400]
    rows = torch.cat([rows[(rows != 7) & (rows != 40)], torch.tensor([7, 40])])
    origins = torch.full((rows.numel(),), STORED, dtype=torch.int32)
    origins[::5] = NEVER
    origins[1::5] = LOGGED - torch.arange(origins[1::5].numel(), dtype=torch.int32) % 100
    origins[-3] = LOGGED - 21  # in the batch on its way, as rows 7 and 40 at their place
    origins[-2:] = STORED
    slots = torch.randperm(1600, generator=torch.Generator().manual_seed(3))[: rows.numel()]
    weight = torch.zeros(1600, 5, dtype=torch.bfloat16)
    state = {"sum": torch.zeros(1600), "moment": torch.zeros(1600, 5)}
    if threads > 1:  # out of the page cache: the threads read from the device
        os.fsync(file.fd)
        os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    never = writes.fetch(rows, slots, origins, weight, state)
    writes.settle()
    assert never is not None and torch.equal(never, torch.nonzero(origins == NEVER).flatten())
    read = origins != NEVER
    record_of = torch.where(origins == STORED, rows, 3000 + LOGGED - origins.long())[read]
    expected = latest[record_of]
    assert torch.equal(
        weight[slots[read]].view(torch.int16), file.weight_of(expected).view(torch.int16)
    )
    for key in state:
        got, want = state[key][slots[read]], file.state_of(expected, key)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaN bits too
    assert not weight[slots[~read]].any()  # left to the caller
    os.truncate(tmp_path / "t.rows", 3006 * file.record + 3)  # record 6 of the log is cut
    cut = torch.tensor([LOGGED - 6], dtype=torch.int32)
    with pytest.raises(StorageError, match=re.escape("cannot read write-log record 6 from ")):
        writes.fetch(torch.tensor([9]), torch.tensor([0]), cut, weight, state)


@needs_kernels
def test_reads_share_kept_threads_across_calls_and_callers(tmp_path):
    """The reading threads are kept between calls, a set per calling thread: many calls from
    four Python threads at once, each split over four, read every record right."""
    import threading

    file = _file(tmp_path / "t.rows", threads=4)
    records = _records(file, 5000, 3)
    file.write(torch.arange(5000), records)
    wrong: list[int] = []

    def reader(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(30):
            rows = torch.randperm(5000, generator=generator)[:1100]
            got = file.empty(rows.numel())
            file.read(rows, got)
            if not torch.equal(got, records[rows]):
                wrong.append(seed)

    callers = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert not wrong
