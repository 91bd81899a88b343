"""BackgroundWrites: a disk-tier block's evicted rows written to its file off the step.

A step's dirty victims used to be written before its rows were read, inside the step: 2.5-4.7 us
a row on this machine, about 40 of the 122 ms a disk step added in the documented workload.
Their records are copied out of the cache at once (the slots take new rows), and the write runs
on a C++ thread while the step goes on (kernels/csrc/row_io.cpp, `BackgroundWrite`: no
interpreter on either side, no Python thread to hand the GIL to; the step measured the same or
slightly faster than with a Python thread pool, docs/benchmarks.md). At most one batch is in
flight: the next eviction, a checkpoint's flush and a load wait for it, and a read of any of its
rows takes them from the batch's own records (`read`), so what is read is never behind the
file's future; an error (a full disk) is raised at the next wait, in the training thread,
naming the file and row. Writes are not split over threads: the file system
takes one file's writes one at a time, and 4 threads wrote slower than one (measured, 8,500
random 260-byte rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.storage.row_file import RowFile

__all__ = ["BackgroundWrites"]


class BackgroundWrites:
    """The one batch of rows on its way to `file`, if any."""

    def __init__(self, file: RowFile) -> None:
        self.file = file
        self._pending: Any = None  # the C++ BackgroundWrite in flight
        self._rows: torch.Tensor | None = None  # ascending: the rows being written
        self._records: torch.Tensor | None = None  # their records, as written

    def submit(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Write `records` to ascending `rows` (the caller's copies: no one else holds them).
        Without the C++ kernels the write holds the GIL, so it runs now instead."""
        self.settle()
        if not native_kernels_take(rows):
            self.file.write(rows, records)
            return
        rows = rows.contiguous()
        self._pending = loaded_kernels().BackgroundWrite(self.file.fd, rows, records)
        self._rows, self._records = rows, records

    @property
    def in_place(self) -> bool:
        """Whether the batch in flight writes rows to their places (not to the write log)."""
        return self._rows is not None and bool(self._rows[0] < self.file.rows)

    def settle(self) -> None:
        """Wait for the write in flight; raise its error here, naming the file and row."""
        pending, rows = self._pending, self._rows
        self._pending, self._rows, self._records = None, None, None
        if pending is not None and rows is not None:
            self.file.check(rows, pending.wait(), "write")

    def fetch(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        origins: torch.Tensor,
        weight: torch.Tensor,
        state: Mapping[str, torch.Tensor],
    ) -> torch.Tensor | None:
        """Rows `rows` into cache `slots` of `weight` and `state` from where `origins` (their
        `slot_of` codes, row_cache.py) say, in one C++ call: each record read straight into
        its slot's rows (one preadv), or copied from the batch in flight (as `read`). Returns
        the positions of the rows never written (the caller generates them), or None where
        the C++ kernels do not take these tensors (then nothing was read)."""
        fields = self.file.native_fields(weight, state)
        if fields is None or not native_kernels_take(rows, slots, origins):
            return None
        if self._pending is not None and self._pending.done():
            self.settle()  # its error, if any, surfaces here
        batch, records = self._rows, self._records
        if batch is None or records is None:
            batch, records = rows[:0], self.file.empty(0)
        never, failed = loaded_kernels().fetch_into_slots(
            self.file.fd,
            self.file.rows,
            rows.contiguous(),
            slots.contiguous(),
            origins.contiguous(),
            batch,
            records,
            *fields,
            self.file.record,
            self.file.threads,
        )
        if failed[0] >= 0:
            self.file.raise_failed(failed[3], failed[1], "read")
        return never

    def read(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Read the records of `rows` into `out`: those of the batch in flight from its own
        records (the bytes being written), the others from the file, without waiting for the
        write. Waiting took seconds at the documented workload: an eviction batch dirties a
        page a row, and the kernel throttles its writer once too many pages are dirty, while
        the next steps' misses often hit a row of that batch (docs/benchmarks.md)."""
        if self._pending is not None and self._pending.done():
            self.settle()  # its error, if any, surfaces here
        batch, records = self._rows, self._records
        if batch is None or records is None:
            self.file.read(rows, out)
            return
        at = torch.searchsorted(batch, rows).clamp_(max=batch.numel() - 1)
        in_flight = batch[at] == rows
        on_file = ~in_flight
        if bool(on_file.all()):
            self.file.read(rows, out)
            return
        out[in_flight] = records[at[in_flight]]
        if bool(on_file.any()):
            rest = self.file.empty(int(on_file.sum()))
            self.file.read(rows[on_file], rest)
            out[on_file] = rest
