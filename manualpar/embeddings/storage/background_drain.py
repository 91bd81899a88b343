"""BackgroundDrain: a write log's oldest records written to their rows' places a bounded piece
per step, on a thread, while the steps go on appending after them.

A drain of a whole log at once stopped training for it: at the documented workload seven steps
of 7-19 s each, 60 s in all, every few thousand steps (docs/benchmarks.md, "The disk tier").
Here, once the log is half full, the records from its tail to its head (an *epoch*) are drained
in the background: the block is walked in row order, a few file chunks per step, each piece's
logged rows of the epoch found in the training thread and written (read, patched and written
back whole where dense, write_log.py) on one thread, without the GIL during the IO. New rows
are appended outside the epoch meanwhile (the log is a ring), so the epoch's records never
change while it runs. Each piece's pace is set so the epoch ends well before the rest of the log
fills, from the rows appended per step so far; if it fills first, the append finishes the
epoch in the training thread.

A row of the piece may be read into the cache, or appended again, while its piece is written:
once written, a row is marked at its place only if its `slot_of` still names the record the
piece wrote (the place then holds an older copy that nothing reads). Anything else that writes
the rows' places (a checkpoint's flush, rows written in place, a load) settles the piece in
flight first, as a chunk rewritten whole would undo it; an error of the piece (a full disk, a
cut file) is raised there or at the next step, in the training thread, naming the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from manualpar.embeddings.storage.background_writes import BackgroundWrites
from manualpar.embeddings.storage.row_cache import LOGGED, RowCache
from manualpar.embeddings.storage.row_file import RowFile

__all__ = ["BackgroundDrain", "DrainedLog"]


class DrainedLog(Protocol):
    """What the drain reads and updates of its write log (write_log.py)."""

    file: RowFile
    cache: RowCache
    writes: BackgroundWrites
    chunk_rows: int
    tail: int
    used: int
    appended: int
    steps: int
    drains: int
    drained: int

    def write_places(self, rows: torch.Tensor, at: torch.Tensor) -> None: ...

    def free(self, records: int) -> None: ...


logger = logging.getLogger(__name__)

START_SHARE = 2  # an epoch starts once 1/START_SHARE of the log is in use
SPARE_SHARE = 4  # paced to end while 1/SPARE_SHARE of the log is still free

# One thread for every block of the process: a piece holds a file chunk and its records (about
# 8 MiB), and one per table at once raised peak RSS 30-40 MiB over the drain in the step (4
# tables, bench_disk_tier.py); queued on one thread, a piece at a time, it stays where it was.
_pool: tuple[int, ThreadPoolExecutor] | None = None


# The drain thread runs at a lower priority than the step (nice +NICE, Linux threads have their
# own): it should take the CPU the steps leave idle, not share the step's cores with it.
NICE = 10


def _thread() -> ThreadPoolExecutor:
    """The process's drain thread (a new one in a process forked from the one that made it)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        pool = ThreadPoolExecutor(1, "disk-tier-drain", initializer=_lower_priority)
        _pool = (os.getpid(), pool)
    return _pool[1]


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not permitted, or not Linux: as is
        thread = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + NICE)
        )


class BackgroundDrain:
    """The background drain of one write log: the epoch running, if any, and its piece."""

    def __init__(self, log: DrainedLog) -> None:
        self.log = log
        self.epoch: tuple[int, int] | None = None  # (first record, records): from the tail
        self.next_row = 0  # the first block row not yet handed to a piece of the epoch
        self.piece: Future[None] | None = None  # the piece in flight
        self.piece_rows = self.piece_at = torch.empty(0, dtype=torch.int64)
        self.written = 0  # rows of the epoch marked at their places
        self.in_step = 0  # file chunks the training thread drained itself (the log filled)
        self.started = 0.0
        self._pid = os.getpid()

    # the steps --------------------------------------------------------------------------------
    def advance(self) -> None:
        """Take the piece in flight if done; begin an epoch once the log is half in use; hand
        the next piece to the thread, sized to the pace the log fills at."""
        self._take(wait=False)
        log = self.log
        if self.epoch is None and log.used * START_SHARE >= log.file.log_rows > 0:
            log.writes.settle()  # the epoch's last batch may be on its way: its records are read
            self.epoch, self.next_row = (log.tail, log.used), 0
            self.written = self.in_step = 0
            self.started = time.perf_counter()
        if self.epoch is None or self.piece is not None:
            return
        if self.next_row < log.file.rows:
            rows, at = self._next_piece(self._chunks_now())
            self._after_writes_in_place()
            self.piece = _thread().submit(log.write_places, rows, at)
            self.piece_rows, self.piece_at = rows, at
        else:
            self._end("in the background")

    def _chunks_now(self) -> int:
        """File chunks for this step's piece: the epoch's rest spread over the steps left
        before all but 1/SPARE_SHARE of the log is in use, at the rows appended a step so far."""
        log = self.log
        chunks = -(-(log.file.rows - self.next_row) // log.chunk_rows)
        per_step = log.appended / max(log.steps, 1)
        room = log.file.log_rows - log.used - log.file.log_rows // SPARE_SHARE
        steps = max(room / max(per_step, 1.0), 1.0)
        return max(1, -int(-chunks // steps))

    def _next_piece(self, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The logged rows of the epoch (ascending) and their records in the next `chunks`
        file chunks of the block."""
        log, epoch = self.log, self.epoch
        assert epoch is not None
        end = min(self.next_row + chunks * log.chunk_rows, log.file.rows)
        rows, at = log.cache.logged_rows(self.next_row, end)
        first, records = epoch
        mine = (at - first) % log.file.log_rows < records
        self.next_row = end
        return rows[mine], at[mine]

    def _after_writes_in_place(self) -> None:
        """Rows on their way to their places (a batch the log could not take) written first:
        a chunk rewritten whole would undo them."""
        if self.log.writes.in_place:
            self.log.writes.settle()

    # waits --------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for the piece in flight and take it; the epoch goes on at the next step."""
        self._take(wait=True)

    def finish(self, why: str) -> None:
        """The epoch's rest drained now, in this thread (the log filled before it ended)."""
        self._take(wait=True)
        if self.epoch is None:
            return
        log = self.log
        self._after_writes_in_place()
        while self.next_row < log.file.rows:
            self.in_step += 1
            rows, at = self._next_piece(1)
            log.write_places(rows, at)
            self._mark(rows, at)
        self._end(why)

    def abandon(self) -> None:
        """The piece in flight taken, the epoch dropped: the caller drains or forgets the whole
        log."""
        self._take(wait=True)
        self.epoch = None

    def _take(self, wait: bool) -> None:
        """The piece in flight, once written (now, if `wait`): its rows whose `slot_of` still
        names the record written marked at their places. Its error is raised here."""
        piece = self.piece
        if piece is None:
            return
        if self._pid != os.getpid():  # forked: the piece and its thread are the parent's
            self.piece, self.epoch = None, None
            self.log.file.check_size("drain the write log of")  # closed here: raises
            return
        if not wait and not piece.done():
            return
        self.piece = None
        piece.result()  # its StorageError, naming the file and row, if any
        self._mark(self.piece_rows, self.piece_at)

    def _mark(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        unchanged = self.log.cache.slot_of[rows] == (LOGGED - at).to(torch.int32)
        self.log.cache.mark_drained(rows[unchanged])
        self.written += int(unchanged.sum())

    def _end(self, how: str) -> None:
        """Every chunk of the block is drained: the epoch's records hold no live row."""
        assert self.epoch is not None
        log = self.log
        log.free(self.epoch[1])
        self.epoch = None
        log.drains += 1
        log.drained += self.written
        logger.info(
            "disk tier: %s: wrote %d logged rows to their places in %.1f s (%s; %d chunks in "
            "the step), %d records still logged",
            log.file.what,
            self.written,
            time.perf_counter() - self.started,
            how,
            self.in_step,
            log.used,
        )
