"""WriteLog: a disk-tier block's evicted rows appended to the end of its file, not written to
their places, until a background drain moves the oldest of them there, or a checkpoint needs
the file whole.

A row written to its place dirties a 4 KiB page of the page cache for its 260 bytes, and an
eviction batch dirtied pages by the hundred thousand: the kernel then throttled the writer and
the step's reads waited behind the writeback (docs/embeddings-storage.md, "The write log").
Appended, a batch is one run of records and one system call per run (kernels/csrc/row_io.cpp):
0.09 us a row against 4.85 us to their places on this machine's ext4 (bench_row_writes.py).

Where a row is lives in its `slot_of` entry (row_cache.py): a slot, NEVER, STORED (at its
place) or LOGGED - record (record `record` of the log), so the log costs no memory. A logged row
read back is marked dirty (row_cache.py), so it is appended again when evicted and its old
record is dropped: the log holds no clean row, and a row's latest record is the one its
`slot_of` names.

The log is a ring: records from `tail` to `head` (in ring order) may be live. Once it is half
full, the records logged so far are drained to their places in the background, a bounded piece
per step (background_drain.py), while new rows go on being appended after them; when that
drain ends, its records are free for the head to wrap into. `drain` writes every logged row to
its place at once (whole chunks of the file where they are dense) and empties the log: before a
checkpoint reads the file (`DiskTable.flush`), so checkpoints still read each row at its place,
and when an append finds no room even after the background drain.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from manualpar.embeddings.storage.background_drain import BackgroundDrain
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
SCAN_ROWS = 2**20  # rows of the block a drain looks at a time


# Each thread's buffer for the chunks it rewrites whole: a fresh 4 MiB tensor a chunk took its
# pages anew each time (the allocator hands them back): a step's chunk reads cost the drain
# thread 3.8 ms of CPU, and 0.8 ms into this buffer (bench_disk_tier.py --cycle, medians of 5
# repeats and both ranks; docs/benchmarks.md).
_chunks = threading.local()


def _chunk_buffer(rows: int, record: int) -> torch.Tensor:
    """This thread's buffer for `rows` records of `record` bytes: contiguous, (rows, record)."""
    size = rows * record
    buffer: torch.Tensor | None = getattr(_chunks, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _chunks.buffer = torch.empty(size, dtype=torch.uint8)
    return buffer[:size].view(rows, record)


class WriteLog:
    """The write log of `file`: its `file.log_rows` records after the rows' places."""

    def __init__(
        self, file: RowFile, cache: RowCache, writes: BackgroundWrites, chunk_rows: int
    ) -> None:
        self.file, self.cache, self.writes, self.chunk_rows = file, cache, writes, chunk_rows
        self.head = 0  # the next free record of the log
        self.tail = 0  # the oldest record that may be live
        self.used = 0  # records from the tail to the head in ring order (skipped ends included)
        self.appended = self.drains = self.drained = 0  # rows appended, drains, rows drained
        self.steps = 0  # steps begun: the rate rows are appended at paces the background drain
        self.background = BackgroundDrain(self)

    def step(self) -> None:
        """A step begins: the background drain's finished piece is taken, the next started."""
        self.steps += 1
        self.background.advance()

    def settle(self) -> None:
        """Wait for the background drain's piece in flight (before anything else writes the
        rows' places: a chunk rewritten whole would undo it)."""
        self.background.settle()

    def append(self, rows: torch.Tensor, records: torch.Tensor) -> bool:
        """Write `records` (of uncached `rows`) at the log's head in the background. Without
        room, the background drain is finished first, or the whole log drained. False, nothing
        done: the log cannot take them (there is none, or they are more than it holds), so the
        caller writes them to their places (the background drain is settled for it)."""
        count = rows.numel()
        if count > self.file.log_rows:
            self.settle()
            return False
        at = self._room(count)
        if at is None:
            self.background.finish("the write log is full")
            at = self._room(count)
        if at is None:  # the rows logged since the background drain began fill it
            self.drain("the write log is full")
            at = 0
        skipped = self.file.log_rows - self.head if at < self.head else 0  # its end, unused
        positions = torch.arange(at, at + count)
        self.writes.submit(self.file.rows + positions, records)
        self.cache.mark_logged(rows, positions)
        self.used += skipped + count
        self.head = (at + count) % self.file.log_rows
        self.appended += count
        return True

    def _room(self, count: int) -> int | None:
        """The first of `count` free records in a run (a batch is written as one run, in
        ascending order), or None if there is none."""
        size = self.file.log_rows
        if self.used + count > size:
            return None
        if self.head < self.tail:  # wrapped: free from the head to the tail
            return self.head if self.head + count <= self.tail else None
        if self.head + count <= size:
            return self.head
        fits = count <= self.tail and self.used + (size - self.head) + count <= size
        return 0 if fits else None

    def free(self, records: int) -> None:
        """The `records` oldest records (from the tail) hold no live row any more."""
        self.tail = (self.tail + records) % self.file.log_rows
        self.used -= records
        if self.used == 0:
            self.head = self.tail = 0

    def drain(self, why: str) -> None:
        """Write every logged row to its place and empty the log; `why` is logged with the
        time it took. The block's rows are taken a range of SCAN_ROWS at a time (the logged
        rows' numbers and records of a whole block took a GiB at the documented workload), and
        each range's rows are marked drained once written: an error leaves every row readable
        where its `slot_of` says."""
        self.background.abandon()  # its piece in flight is written first; this takes the rest
        self.writes.settle()
        started = time.perf_counter()
        drained = 0
        for start in range(0, self.file.rows, SCAN_ROWS):
            rows, at = self.cache.logged_rows(start, start + SCAN_ROWS)
            self.write_places(rows, at)
            self.cache.mark_drained(rows)
            drained += rows.numel()
        self.head = self.tail = self.used = 0
        if drained:
            self.drains += 1
            self.drained += drained
            logger.info(
                "disk tier: %s: wrote %d logged rows to their places in %.1f s (%s)",
                self.file.what,
                drained,
                time.perf_counter() - started,
                why,
            )

    def write_places(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        """Logged `rows` (ascending; records `at`) written to their places; the caller marks
        them. A file chunk holding at least 1/DENSE_SHARE of them is read, patched and written
        back whole; the others are written a record each. Runs in the background drain's
        thread too: it touches the file and its arguments only."""
        if not rows.numel():
            return
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
            block = self.file.read_range(start, end, _chunk_buffer(end - start, self.file.record))
            logged = self._records(at[first:last]).view(torch.int32)
            block.view(torch.int32).index_copy_(0, rows[first:last] - start, logged)
            self.file.write_range(start, block)
            scattered[first:last] = False
        sparse_rows, sparse_at = rows[scattered], at[scattered]
        for first in range(0, sparse_rows.numel(), chunk):
            records = self._records(sparse_at[first : first + chunk])
            self.file.write(sparse_rows[first : first + chunk], records)

    def _records(self, at: torch.Tensor) -> torch.Tensor:
        """The log's records `at`, in that order (read in log order: runs move in one call).
        Rows of bytes move with index_select and index_copy_ on 4-byte words (a record is
        whole words): indexing uint8 rows cost 0.12 us a row, these 0.01-0.02 us."""
        in_log_order, order = torch.sort(at)
        records = self.file.empty(at.numel())
        self.file.read(self.file.rows + in_log_order, records)
        return records.index_select(0, torch.argsort(order))

    def forget(self) -> None:
        """The file's rows were all rewritten at their places (a load, a fill): the log's
        records are stale; the cache has already been told where its rows are."""
        self.background.abandon()
        self.writes.settle()
        self.head = self.tail = self.used = 0
