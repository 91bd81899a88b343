"""A load's writes into a disk table's file: one field (the weights or one optimizer state) of
a run of rows, written with pwrite in whole records, never through the file's map.

A checkpoint load used to copy the rows into views of the file's map: the first write of each
page through a map cost 35-84 us per row against 7 us with pwrite, and was most of a 1 GB
load (docs/benchmarks.md). A field is part of each record, so a run of records is read (one
pread), the field patched and the run written back (one pwrite), a bounded piece at a time:
memory stays about one piece whatever the run. Rows the file holds as reserved zeros (never
written, and no unfinished load handed them out: `begin`) are not read: the piece starts from
zeros. That read was most of what was left: reading a reserved, never written range fills the
page cache with zeros page by page (3.7 s of a 5.5 s read of a 0.25 GB table, one process,
loaded 2-core machine). The load has the tier's file to itself (disk_tier.py: the cache's
dirty rows and the write log were written back before it was handed over, and the cache is
dropped after it), so nothing else writes these records meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manualpar.embeddings.storage.row_file import RowFile

__all__ = ["PIECE_BYTES", "FieldWrites"]

PIECE_BYTES = 8 * 2**20  # records read, patched and written at once: a checkpoint chunk's


class FieldWrites:
    """Writes fields of `file`'s records through one reused buffer of records."""

    def __init__(self, file: RowFile) -> None:
        self.file = file
        self.piece_rows = max(1, PIECE_BYTES // file.record)
        self._records: torch.Tensor | None = None
        self._zeros: torch.Tensor | None = None  # by row: still the reserved zeros
        self._zeroed: tuple[str | None, int, int] | None = None  # the buffer's field, if the
        # rest of it is zeros
        self.calls = 0  # writes so far (tests: a load went this way, not through the map)

    def begin(self, zeros: torch.Tensor | None) -> None:
        """A load starts: `zeros` (bool, by row) marks the rows the file holds as reserved
        zeros, which are not read before their fields are written (None: read every row)."""
        self._zeros = zeros

    def write(
        self, key: str | None, first: int, offsets: Sequence[int], values: torch.Tensor
    ) -> None:
        """Set field `key` (None: the weights) of rows first + offsets[0] on, from column
        offsets[1] on (if the field has columns), to `values`: (rows,) for a per-row state,
        (rows, columns) for the others."""
        self.calls += 1
        row = first + int(offsets[0])
        column = int(offsets[1]) if len(offsets) > 1 else 0
        for start in range(0, len(values), self.piece_rows):
            part = values[start : start + self.piece_rows]
            records = self._buffer(len(part))
            at = row + start
            self._other_fields(records, at, (key, column, part.shape[-1]))
            self._field(records, key, column, part).copy_(part)
            self.file.write_range(at, records)
            if self._zeros is not None:
                self._zeros[at : at + len(part)] = False

    def release(self) -> None:
        """Free the buffer and forget the zero rows (after a load)."""
        self._records = self._zeros = self._zeroed = None

    def _other_fields(
        self, records: torch.Tensor, at: int, field: tuple[str | None, int, int]
    ) -> None:
        """Put the file's bytes of records `at`.. beside `field` into `records`: nothing when
        the field is the whole record, zeros for rows still reserved, else a read."""
        key, column, width = field
        file = self.file
        if (
            key is None
            and not file.fields
            and column == 0
            and width == file.cols
            and file.weight_bytes == file.cols * file.dtype.itemsize
        ):
            self._zeroed = None  # the whole buffer is written
            return
        zeros = self._zeros
        if zeros is not None and bool(zeros[at : at + len(records)].all()):
            if self._zeroed != field:  # else only `field`'s bytes were written since
                records.zero_()
                self._zeroed = field
            return
        self._zeroed = None
        file.read_range(at, at + len(records), out=records)

    def _field(
        self, records: torch.Tensor, key: str | None, column: int, part: torch.Tensor
    ) -> torch.Tensor:
        """The view of `records` that `part` goes to."""
        if key is None:
            return self.file.weight_of(records)[:, column : column + part.shape[-1]]
        state = self.file.state_of(records, key)
        return state if state.dim() == 1 else state[:, column : column + part.shape[-1]]

    def _buffer(self, count: int) -> torch.Tensor:
        if self._records is None:  # pages are touched only as far as the pieces reach
            self._records = self.file.empty(self.piece_rows)
        return self._records[:count]
