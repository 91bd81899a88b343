"""WriteLog: a disk-tier block's evicted rows appended to the end of its file, not written to
their places, until the log is full or a checkpoint needs the file whole.

A row written to its place dirties a 4 KiB page of the page cache for its 260 bytes, and an
eviction batch dirtied pages by the hundred thousand: the kernel then throttled the writer and
the step's reads waited behind the writeback (docs/embeddings-storage.md, "The write log").
Appended, a batch is one run of records and one system call per run (kernels/csrc/row_io.cpp):
0.09 us a row against 4.85 us to their places on this machine's ext4 (bench_row_writes.py).

Where a row is lives in its `slot_of` entry (row_cache.py): a slot, NEVER, STORED (at its
place) or LOGGED - record (record `record` of the log), so the log costs no memory. A logged row
read back is marked dirty (row_cache.py), so it is appended again when evicted and its old
record is dropped: the log holds no clean row, and a row's latest record is the one its
`slot_of` names. `drain` writes the logged rows to their places (whole chunks of the file
where they are dense) and empties the log: when an append would not fit, and before a
checkpoint reads the file (`DiskTable.flush`), so checkpoints still read each row at its place.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from manualpar.embeddings.storage.background_writes import BackgroundWrites
from manualpar.embeddings.storage.row_cache import RowCache
from manualpar.embeddings.storage.row_file import RowFile

__all__ = ["WriteLog"]

logger = logging.getLogger(__name__)

# A chunk of the file with at least 1/DENSE_SHARE of its rows logged is rewritten whole. A 4 MiB
# chunk read, patched and written back took 8.5 ms (2 GB file, synced); one record written to
# its place 56 us where its page had to be read first (written before, not in memory), 11 us in
# the documented workload (much of the file never written): break-even at 1/109 and 1/22 of a
# chunk's rows. A full log holds far denser rows than either.
DENSE_SHARE = 32

# A log drained because it is full keeps the rows of its last quarter in the log (moved to its
# start): they are the ones evicted last, the likeliest to be read back soon, and their records
# are in the page cache. Drained to their places with the rest, they were read back from
# pages the drain's writes had pushed out of it (documented workload: steps of 40 ms before a
# drain, 280 ms after it).
KEEP_SHARE = 4
SCAN_ROWS = 2**20  # rows of the block a drain looks at a time


class WriteLog:
    """The write log of `file`: its `file.log_rows` records after the rows' places."""

    def __init__(
        self, file: RowFile, cache: RowCache, writes: BackgroundWrites, chunk_rows: int
    ) -> None:
        self.file, self.cache, self.writes, self.chunk_rows = file, cache, writes, chunk_rows
        self.head = 0  # the next free record of the log
        self.appended = self.drains = self.drained = 0  # rows appended, drains, rows drained

    def append(self, rows: torch.Tensor, records: torch.Tensor) -> bool:
        """Write `records` (of uncached `rows`) at the log's end in the background; drains the
        log first if they do not fit. False, nothing done: the log cannot take them (there is
        none, or they are more than it holds), so the caller writes them to their places."""
        count = rows.numel()
        if count > self.file.log_rows:
            return False
        if self.head + count > self.file.log_rows:
            self.drain("the write log is full", keep_recent=True)
        if self.head + count > self.file.log_rows:  # the rows kept and these do not fit
            self.drain("the write log is full")
        at = torch.arange(self.head, self.head + count)
        self.writes.submit(self.file.rows + at, records)
        self.cache.mark_logged(rows, at)
        self.head += count
        self.appended += count
        return True

    def drain(self, why: str, keep_recent: bool = False) -> None:
        """Write every logged row to its place and empty the log; `why` is logged with the
        time it took. `keep_recent`: the rows of the last 1/KEEP_SHARE of the log stay logged,
        moved to its start (see KEEP_SHARE). The block's rows are taken a range of SCAN_ROWS
        at a time (the logged rows' numbers and records of a whole block took a GiB at the
        documented workload), and each range's rows are marked drained once written: an error
        leaves every row readable where its `slot_of` says."""
        self.writes.settle()
        started = time.perf_counter()
        kept = self.head - self.file.log_rows // KEEP_SHARE  # records from here on are kept
        if not keep_recent or kept < self.file.log_rows // KEEP_SHARE:  # moved, they'd overlap
            kept = self.head
        drained = 0
        for start in range(0, self.file.rows, SCAN_ROWS):
            rows, at = self.cache.logged_rows(start, start + SCAN_ROWS)
            cold = at < kept
            drained += self._to_places(rows[cold], at[cold])
        self.head = 0
        for start in range(0, self.file.rows, SCAN_ROWS):  # what is left is kept
            self._move_to_head(*self.cache.logged_rows(start, start + SCAN_ROWS))
        if drained:
            self.drains += 1
            self.drained += drained
            logger.info(
                "disk tier: %s: wrote %d logged rows to their places in %.1f s, kept %d (%s)",
                self.file.what,
                drained,
                time.perf_counter() - started,
                self.head,
                why,
            )

    def _to_places(self, rows: torch.Tensor, at: torch.Tensor) -> int:
        """Logged `rows` (ascending; records `at`) written to their places and marked so. A
        file chunk holding at least 1/DENSE_SHARE of them is read, patched and written back
        whole; the others are written a record each."""
        if not rows.numel():
            return 0
        chunk = self.chunk_rows
        first_chunk = int(rows[0]) // chunk
        starts = torch.arange(first_chunk, int(rows[-1]) // chunk + 2) * chunk
        bounds = torch.searchsorted(rows, starts).tolist()
        scattered = torch.ones(rows.numel(), dtype=torch.bool)
        for index, (first, last) in enumerate(itertools.pairwise(bounds)):
            if (last - first) * DENSE_SHARE < chunk:
                continue
            start = (first_chunk + index) * chunk
            end = min(start + chunk, self.file.rows)
            block = self.file.read_range(start, end)
            block[rows[first:last] - start] = self._records(at[first:last])
            self.file.write_range(start, block)
            scattered[first:last] = False
        sparse_rows, sparse_at = rows[scattered], at[scattered]
        for first in range(0, sparse_rows.numel(), chunk):
            records = self._records(sparse_at[first : first + chunk])
            self.file.write(sparse_rows[first : first + chunk], records)
        self.cache.mark_drained(rows)
        return rows.numel()

    def _move_to_head(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        """Logged `rows` (records `at`, all past the head and past where they go) moved to the
        records from the head on: read in log order, one run written a chunk at a time."""
        at, order = torch.sort(at)
        rows = rows[order]
        for first in range(0, rows.numel(), self.chunk_rows):
            count = min(self.chunk_rows, rows.numel() - first)
            records = self.file.empty(count)
            self.file.read(self.file.rows + at[first : first + count], records)
            to = torch.arange(self.head, self.head + count)
            self.file.write(self.file.rows + to, records)
            self.cache.mark_logged(rows[first : first + count], to)
            self.head += count

    def _records(self, at: torch.Tensor) -> torch.Tensor:
        """The log's records `at`, in that order (read in log order: runs move in one call)."""
        in_log_order, order = torch.sort(at)
        records = self.file.empty(at.numel())
        self.file.read(self.file.rows + in_log_order, records)
        out = torch.empty_like(records)
        out[order] = records
        return out

    def forget(self) -> None:
        """The file's rows were all rewritten at their places (a load, a fill): the log's
        records are stale; the cache has already been told where its rows are."""
        self.writes.settle()
        self.head = 0
