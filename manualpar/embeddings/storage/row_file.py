"""RowFile: one table block on disk, a fixed-size record per row (the weights in the table's
dtype, then each optimizer state tensor in float32), read and written with pread/pwrite.
Row r's place is record r; `log_rows` more records after them hold the write log (write_log.py).

One record per row means one system call per row moved, whatever the optimizer (separate files
per tensor took one per tensor). A batch of rows moves in one C++ call (kernels/csrc/row_io.cpp,
without the interpreter or the GIL, reads over `threads` threads); the Python loop is the
fallback. pread/pwrite rather than stores into a memory map: the first write to a never-written
page of the reserved file cost 35-84 us per row through the map against 7 us with pwrite
(16,000 random 256-byte rows of a 1 GB file, this machine), and pages of a map count as the
process's resident memory. The map is kept only for checkpoints, whose blocks are views of it
(released after use): a save reads through it, a load writes with pwrite (field_writes.py).

The file is reserved with fallocate: no bytes are written (a 36 GB table costs no 36 GB of
writes at start) and a disk without room is reported at once instead of failing mid-training.
So a file shorter than its reservation was cut by another process: each step, flush, range read
and checkpoint chunk checks that first (one fstat), since a write into a cut file regrows it
over a hole that reads back as zero rows, and the map meets it as SIGBUS. The tier opens only
a plain file of its own (no link followed: it empties the file), private to its user, and a
process forked from the tier's lets go of its files (they hold the tier's lock, file_owner.py).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch

from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.plan import format_bytes
from manualpar.embeddings.storage.file_owner import claim_file, owner_path
from manualpar.errors import BuilderError, StorageError

__all__ = ["RowFile"]

STATE_DTYPE = torch.float32


class RowFile:
    """`rows` records at `path`: weights (`cols` of `dtype`) and `state` ({key: per-row})."""

    def __init__(
        self,
        path: Path,
        rows: int,
        cols: int,
        dtype: torch.dtype,
        state: Mapping[str, bool],
        what: str,
        threads: int = 1,
        log_rows: int = 0,
    ) -> None:
        self.path, self.rows, self.cols, self.dtype = path, rows, cols, dtype
        self.log_rows = log_rows  # records after the rows' places: the write log
        self.threads = threads  # reading batches of rows (C++ path)
        self.weight_bytes = -(-cols * dtype.itemsize // 4) * 4  # state stays 4-byte aligned
        self.fields: dict[str, tuple[int, bool]] = {}  # key -> (byte offset, per row)
        offset = self.weight_bytes
        for key, per_row in state.items():
            self.fields[key] = (offset, per_row)
            offset += (1 if per_row else cols) * STATE_DTYPE.itemsize
        self.record = offset
        self.what = what
        holds = (
            f"{what}: {rows} rows x {cols} {str(dtype).removeprefix('torch.')}, "
            f"state {sorted(state)}, {offset} bytes a row, {log_rows} write-log records"
        )
        self.fd = _reserve(path, rows * self.record, log_rows * self.record, what, {"holds": holds})
        self._map: mmap.mmap | None = None
        _OPEN_FILES.add(self)

    # records <-> tensors ------------------------------------------------------------------------
    def empty(self, count: int) -> torch.Tensor:
        return torch.empty(count, self.record, dtype=torch.uint8)

    def weight_of(self, records: torch.Tensor) -> torch.Tensor:
        """The weights of `records` (n, record bytes), a view."""
        return records[:, : self.cols * self.dtype.itemsize].view(self.dtype)

    def state_of(self, records: torch.Tensor, key: str) -> torch.Tensor:
        """One state tensor of `records`: (n,) per row or (n, cols), a view."""
        offset, per_row = self.fields[key]
        width = 1 if per_row else self.cols
        view = records[:, offset : offset + width * STATE_DTYPE.itemsize].view(STATE_DTYPE)
        return view[:, 0] if per_row else view

    def to_slots(
        self,
        records: torch.Tensor,
        slots: torch.Tensor,
        weight: torch.Tensor,
        state: Mapping[str, torch.Tensor],
    ) -> None:
        """Each record's weights and state into rows `slots` of the cache tensors."""
        tensors = self.native_fields(weight, state)
        if tensors is not None:
            loaded_kernels().records_to_slots(records, slots, *tensors)
            return
        for cache, field in self._field_pairs(records, weight, state):
            cache.index_copy_(0, slots, field.to(cache.device))

    def from_slots(
        self,
        records: torch.Tensor,
        slots: torch.Tensor,
        weight: torch.Tensor,
        state: Mapping[str, torch.Tensor],
    ) -> None:
        """Rows `slots` of the cache tensors into `records` (a write-back's copy)."""
        tensors = self.native_fields(weight, state)
        if tensors is not None:
            loaded_kernels().slots_to_records(records, slots, *tensors)
            return
        for cache, field in self._field_pairs(records, weight, state):
            field.copy_(cache.index_select(0, slots))

    def _field_pairs(
        self, records: torch.Tensor, weight: torch.Tensor, state: Mapping[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cache tensor, the records' view of its field) for the weights and each state."""
        pairs = [(weight, self.weight_of(records))]
        return pairs + [(tensor, self.state_of(records, key)) for key, tensor in state.items()]

    def native_fields(
        self, weight: torch.Tensor, state: Mapping[str, torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[int]] | None:
        """The cache tensors and their fields' offsets, where one C++ copy per field moves them
        (CPU, contiguous, the record's dtypes); None: the torch path."""
        tensors = [weight, *state.values()]
        if not native_kernels_take(*tensors) or not all(t.is_contiguous() for t in tensors):
            return None
        if weight.dtype != self.dtype or any(t.dtype != STATE_DTYPE for t in state.values()):
            return None
        return tensors, [0, *(self.fields[key][0] for key in state)]

    # IO -------------------------------------------------------------------------------------------
    def read(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Records of distinct `rows` (int64 record numbers, any order) into `out` (n, record)."""
        if native_kernels_take(rows):
            failed = loaded_kernels().read_records(self.fd, rows.contiguous(), out, self.threads)
            self.check(rows, failed, "read")
            return
        buffer, size = out.numpy(), self.record
        for i, row in enumerate(rows.tolist()):
            if os.preadv(self.fd, [buffer[i]], row * size) != size:
                raise self._short(self.record_name(row))

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Records `records` (n, record, contiguous) to distinct `rows`."""
        if native_kernels_take(rows):
            # one thread: the file system takes one file's writes one at a time
            failed = loaded_kernels().write_records(self.fd, rows.contiguous(), records, 1)
            self.check(rows, failed, "write")
            return
        buffer, size = records.numpy(), self.record
        for i, row in enumerate(rows.tolist()):
            if os.pwrite(self.fd, buffer[i], row * size) != size:
                name = self.record_name(row)
                raise StorageError(errno.ENOSPC, f"short write of {name} to {self.path}")

    def check(self, rows: torch.Tensor, failed: list[int], how: str) -> None:
        """Raise for the C++ batch's first failed row (kernels/csrc/row_io.cpp), if any."""
        index, error, _ = failed[:3]
        if index >= 0:
            self.raise_failed(int(rows[index]), error, how)

    def raise_failed(self, record: int, error: int, how: str) -> None:
        """Raise StorageError for a failed read or write of `record` (errno `error`, 0: the
        file ended)."""
        row = self.record_name(record)
        if error:
            raise StorageError(error, f"cannot {how} {row} of {self.path}: {os.strerror(error)}")
        if how == "read":
            raise self._short(row)
        raise StorageError(errno.ENOSPC, f"short write of {row} to {self.path}")

    def record_name(self, record: int) -> str:
        """A record number as errors name it: a row, or a record of the write log."""
        return f"row {record}" if record < self.rows else f"write-log record {record - self.rows}"

    def read_range(self, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Records [start, end) into `out` (contiguous; a new tensor if None)."""
        self.check_size(f"read rows {start}..{end - 1} from")  # a hole would read as zeros
        out = self.empty(end - start) if out is None else out
        view = out.numpy().data.cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], start * self.record + done)
            if got <= 0:
                raise self._short(f"rows {start}..{end - 1}")
            done += got
        return out

    def write_range(self, start: int, records: torch.Tensor) -> None:
        self.check_size(f"write rows {start}..{start + records.shape[0] - 1} to")
        view = records.contiguous().numpy().data.cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], start * self.record + done)

    @property
    def reserved(self) -> int:
        """The file's bytes as reserved: the rows' records, then the write log's."""
        return (self.rows + self.log_rows) * self.record

    def check_size(self, doing: str) -> None:
        """Raise StorageError, saying what was `doing` ("write rows back to"), if the file is
        shorter than reserved: written into, a cut file grows back over a hole that reads as
        zero rows, and a map of it meets SIGBUS. One fstat (a step, flush, range or chunk)."""
        if self.fd < 0:
            raise StorageError(
                f"disk tier: {self.what}: cannot {doing} {str(self.path)!r}: this process "
                "closed it, or was forked from the process that holds it (the two would write "
                "one file); use a disk table in the process that built it"
            )
        size = os.fstat(self.fd).st_size
        if size < self.reserved:
            raise self._cut(doing, size)

    def _short(self, rows: str) -> StorageError:
        """A read past the end: the file lost bytes since the tier reserved it."""
        return self._cut(f"read {rows} from", os.fstat(self.fd).st_size)

    def _cut(self, doing: str, size: int) -> StorageError:
        log = f" and {self.log_rows} write-log records" if self.log_rows else ""
        return StorageError(
            f"disk tier: {self.what}: cannot {doing} {str(self.path)!r}: the file has "
            f"{format_bytes(size)}, {format_bytes(self.reserved)} were reserved for {self.rows} "
            f"rows{log}; it was truncated or replaced while this tier held it. Its rows are "
            "lost: restart from the last checkpoint (and keep other processes out of the tier's "
            "directory)",
        )

    # checkpoints ----------------------------------------------------------------------------------
    def mapped(self) -> torch.Tensor:
        """All records as a (rows, record) uint8 view of a shared map of the file (for
        checkpoints: reading or writing it is reading or writing the file)."""
        self.check_size("map rows of")
        if self._map is None:
            self._map = mmap.mmap(
                self.fd, self.rows * self.record, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        return torch.frombuffer(self._map, dtype=torch.uint8).view(self.rows, self.record)

    def release_pages(self) -> None:
        """Unmap the map's pages (the data stays in the page cache and the file): mapped pages
        count as resident memory."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Close the file and its map: each holds the tier's lock (file_owner.py)."""
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a checkpoint's views still hold it
                self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown there is nothing to do
            self.close()


_OPEN_FILES: weakref.WeakSet[RowFile] = weakref.WeakSet()


def _let_go_in_child() -> None:
    """In a process just forked from the tier's (a data-loader worker, say): close the
    inherited files and maps. The lock is the open file's, so the child's copies would keep it
    after the tier's process ended, and refuse the next job the files."""
    for file in list(_OPEN_FILES):
        file.close()


os.register_at_fork(after_in_child=_let_go_in_child)


def _reserve(path: Path, row_bytes: int, log_bytes: int, what: str, holds: dict[str, str]) -> int:
    """A new file of the rows' and the write log's bytes reserved on disk (fallocate: unwritten
    blocks read as zeros), open for reading and writing, private to this user, locked for this
    tier (file_owner.py) before it is emptied. A directory that cannot be written, a file
    another tier holds or a full disk raise BuilderError naming the file; a link or anything
    but a plain file there, StorageError."""
    fd = _open_plain(path, what)
    try:
        claim_file(fd, path, what, holds)
        os.fchmod(fd, 0o600)  # a file left by an earlier job keeps its mode otherwise
    except BaseException:
        os.close(fd)  # the other tier's file is left as it was
        raise
    try:
        os.ftruncate(fd, 0)  # a fresh block: rows never written read as zeros
        os.posix_fallocate(fd, 0, row_bytes + log_bytes)
    except OSError as error:
        os.close(fd)
        free = shutil.disk_usage(path.parent).free
        path.unlink(missing_ok=True)
        owner_path(path).unlink(missing_ok=True)
        reason = "the disk is full" if error.errno == errno.ENOSPC else error.strerror
        log = f" ({format_bytes(log_bytes)} of it the write log)" if log_bytes else ""
        fixes = "choose another DiskTier(directory=...), or keep fewer tables on disk"
        if log_bytes:
            fixes = (
                "choose another DiskTier(directory=...), keep fewer tables on disk, or give "
                "DiskTier a smaller write_log="
            )
        raise BuilderError(
            f"disk tier: cannot reserve {format_bytes(row_bytes + log_bytes)}{log} for {what} "
            f"file {str(path)!r} ({reason}; {format_bytes(free)} free there); free disk space, "
            f"{fixes}"
        ) from None
    return fd


def _open_plain(path: Path, what: str) -> int:
    """`path` opened (created if need be) without following a link, refused unless a plain
    file of one name: the tier empties it, which through a link or a second name would empty
    another file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP and path.is_symlink():
            raise _not_plain(path, what, "a symbolic link") from None
        raise BuilderError(
            f"disk tier: cannot write {what} file {str(path)!r}: {error.strerror}; give "
            "DiskTier(directory=...) a directory this process can write"
        ) from None
    info = os.fstat(fd)
    kind = None
    if not stat.S_ISREG(info.st_mode):
        kind = "not a plain file"
    elif info.st_nlink > 1:
        kind = f"a plain file with {info.st_nlink} names (hard links)"
    if kind is not None:
        os.close(fd)
        raise _not_plain(path, what, kind)
    return fd


def _not_plain(path: Path, what: str, kind: str) -> StorageError:
    return StorageError(
        f"disk tier: the {what} file {str(path)!r} is {kind}; the tier empties its files when "
        "it opens them and does not follow links: remove it, or give DiskTier(directory=...) a "
        "directory of its own"
    )
