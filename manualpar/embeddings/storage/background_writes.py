"""BackgroundWrites: a disk-tier block's evicted rows written to its file off the step.

A step's dirty victims used to be written before its rows were read, inside the step: 2.5-4.7 us
a row on this machine, about 40 of the 122 ms a disk step added in the documented workload.
Their records are copied out of the cache at once (the slots take new rows), and the write runs
on a C++ thread while the step goes on (kernels/csrc/row_io.cpp, `BackgroundWrite`: no
interpreter on either side, no Python thread to hand the GIL to; the step measured the same or
slightly faster than with a Python thread pool, docs/embeddings.md). At most one batch is in
flight: the next eviction, a checkpoint's flush, a load and a read of any of its rows wait for
it, so the file is never behind when it is read, and an error (a full disk) is raised there, in
the training thread, naming the file and row. Writes are not split over threads: the file system
takes one file's writes one at a time, and 4 threads wrote slower than one (measured, 8,500
random 260-byte rows).
"""

from __future__ import annotations

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

    def submit(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Write `records` to ascending `rows` (the caller's copies: no one else holds them).
        Without the C++ kernels the write holds the GIL, so it runs now instead."""
        self.settle()
        if not native_kernels_take(rows):
            self.file.write(rows, records)
            return
        rows = rows.contiguous()
        self._pending = loaded_kernels().BackgroundWrite(self.file.fd, rows, records)
        self._rows = rows

    def settle(self) -> None:
        """Wait for the write in flight; raise its error here, naming the file and row."""
        pending, rows, self._pending, self._rows = self._pending, self._rows, None, None
        if pending is not None and rows is not None:
            self.file.check(rows, pending.wait(), "write")

    def settle_if_writing(self, rows: torch.Tensor) -> None:
        """Wait for the write in flight if it holds any of `rows` (about to be read)."""
        if self._rows is None:
            return
        if self._pending is not None and self._pending.done():
            self.settle()
            return
        if bool(torch.isin(rows, self._rows, assume_unique=True).any()):
            self.settle()
