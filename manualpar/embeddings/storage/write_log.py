"""WriteLog: a disk-tier block's evicted rows appended to the end of its file, not written to
their places, until the log is full or a checkpoint needs the file whole.

A row written to its place dirties a 4 KiB page of the page cache for its 260 bytes, and an
eviction batch dirtied pages by the hundred thousand: the kernel then throttled the writer and
the step's reads waited behind the writeback (docs/embeddings.md, "The write log"). Appended,
a batch is one run of records and one system call per run (kernels/csrc/row_io.cpp): 0.09 us
a row against 4.85 us to their places on this machine's ext4 (bench_row_writes.py).

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
        time it took. A file chunk holding at least 1/DENSE_SHARE logged rows is read, patched
        and written back whole; the other rows are written one record each, by ascending row.
        The rows are marked drained once all are written: an error leaves the log as it was.
        `keep_recent`: the rows of the last 1/KEEP_SHARE of the log stay logged, moved to its
        start (see KEEP_SHARE)."""
        self.writes.settle()
        rows, at = self.cache.logged_rows()
        kept = self.head - self.file.log_rows // KEEP_SHARE  # records from here on are kept
        if keep_recent and kept >= self.file.log_rows // KEEP_SHARE:  # no overlap when moved
            recent = at >= kept
            kept_rows, kept_at = rows[recent], at[recent]
            rows, at = rows[~recent], at[~recent]
        else:
            kept_rows = kept_at = rows[:0]
        if rows.numel():
            started = time.perf_counter()
            chunk = self.chunk_rows
            starts = torch.arange(0, self.file.rows + chunk, chunk).clamp_(max=self.file.rows)
            bounds = torch.searchsorted(rows, starts).tolist()
            scattered = torch.ones(rows.numel(), dtype=torch.bool)
            for index, (first, last) in enumerate(itertools.pairwise(bounds)):
                if (last - first) * DENSE_SHARE < chunk:
                    continue
                start, end = index * chunk, min((index + 1) * chunk, self.file.rows)
                block = self.file.read_range(start, end)
                block[rows[first:last] - start] = self._records(at[first:last])
                self.file.write_range(start, block)
                scattered[first:last] = False
            sparse_rows, sparse_at = rows[scattered], at[scattered]
            for first in range(0, sparse_rows.numel(), chunk):
                records = self._records(sparse_at[first : first + chunk])
                self.file.write(sparse_rows[first : first + chunk], records)
            self.cache.mark_drained(rows)
            self.drains += 1
            self.drained += rows.numel()
            logger.info(
                "disk tier: %s: wrote %d logged rows to their places in %.1f s (%s)",
                self.file.what,
                rows.numel(),
                time.perf_counter() - started,
                why,
            )
        self.head = 0
        self._move_to_start(kept_rows, kept_at)

    def _move_to_start(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        """Logged `rows` (records `at`, all past where they go) moved to the log's first
        records, in log order: one run read and one written a chunk at a time."""
        at, order = torch.sort(at)
        rows = rows[order]
        for first in range(0, rows.numel(), self.chunk_rows):
            records = self.file.empty(min(self.chunk_rows, rows.numel() - first))
            self.file.read(self.file.rows + at[first : first + records.shape[0]], records)
            self.file.write(self.file.rows + torch.arange(first, first + records.shape[0]), records)
        self.cache.mark_logged(rows, torch.arange(rows.numel()))
        self.head = rows.numel()

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
