"""Checking a sharded checkpoint's files before a load copies anything into the live state.

torch.distributed.checkpoint reads each tensor straight into the live parameters, optimizer
states and table blocks (a disk table's blocks are its file), one after another: a file that
fails half-way would leave the state part new, part old. So every file is checked first, on
every rank, and the ranks agree on the outcome before any of them copies a value:

- sizes (every rank, no data read): each file the metadata names exists and holds every byte
  range recorded in it, so a truncated or missing file is found at the cost of a `stat`;
- contents: each tensor to load is a zip archive (torch.save's format) whose members match
  the CRC-32 recorded at save time, computed over the file's mapped pages (no tensor is
  built and nothing is copied, so the check adds no memory). The tensors are split among the
  ranks by size: each rank reads about 1/world of what is loaded once more (from the page
  cache when the checkpoint fits in it);
- the object files (replicated.pt, rank_<r>.pt) and a full export are checked the same way.

Guaranteed: a missing, truncated or changed tensor or object file fails the load on every
rank with nothing modified. Not covered: a file that changes or fails to read between the
check and the read (the error then says the state may be partly loaded); members saved without
a CRC-32 (`torch.serialization.set_crc32_options(False)`), which get the structural check only.
A load's `verify="sizes"` runs the sizes check alone on the tensor files (`check_tensor_sizes`):
missing and truncated files are still refused, changed bytes are not.
"""

from __future__ import annotations

import io
import mmap
import os
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manualpar.checkpoint.archive import LOCAL_HEADER_SIZE, ArchiveSlice, data_start
from manualpar.checkpoint.files import describe_failure
from manualpar.errors import CheckpointError

__all__ = ["check_object_file", "check_tensor_files", "check_tensor_sizes"]

_CHUNK = 1 << 20
_CRC_CHUNK = 8 << 20
_NOTHING_LOADED = (
    "load an older checkpoint (the Trainer falls back to the newest intact one by itself) or "
    "copy this one again; nothing was loaded"
)


@dataclass(frozen=True)
class _Item:
    """Where one saved tensor (or block of one) lies: file, byte range."""

    key: str
    file: str
    offset: int
    length: int
    plain: bool  # saved without a storage transform: the bytes are torch.save's zip archive

    @property
    def end(self) -> int:
        return self.offset + self.length


def check_tensor_files(
    path: Path, metadata: Any, keys: Iterable[str], rank: int, world_size: int
) -> None:
    """Raise CheckpointError naming the file, tensor and cause unless every byte range of the
    tensors `keys` is present (all of them) and intact (this rank's share of them)."""
    items = _items(metadata, set(keys))
    _check_sizes(path, items)
    mine = [item for item in _share(items, rank, world_size) if item.plain]
    for file in sorted({item.file for item in mine}):
        with _mapped(path / file) as (handle, data):
            for item in (item for item in mine if item.file == file):
                _check_item(path, item, handle, data)


def check_tensor_sizes(path: Path, metadata: Any, keys: Iterable[str]) -> None:
    """Raise CheckpointError naming the file and tensor unless every byte range of the tensors
    `keys` is present (a `stat` per file, no data read: a load's `verify="sizes"`)."""
    _check_sizes(path, _items(metadata, set(keys)))


def check_object_file(file: Path) -> None:
    """Raise CheckpointError unless `file` (a torch.save archive: an object file, a full
    export) is intact."""
    try:
        with _mapped(file) as (handle, data):
            _check_archive(handle, data, 0, len(data))
    except Exception as error:
        raise CheckpointError(
            f"{file} is corrupted or truncated ({describe_failure(error)}); {_NOTHING_LOADED}"
        ) from None


def _items(metadata: Any, keys: set[str]) -> list[_Item]:
    """The byte ranges of `keys`' tensors, by file and offset."""
    return sorted(
        (
            _Item(
                index.fqn,
                info.relative_path,
                info.offset,
                info.length,
                not getattr(info, "transform_descriptors", None),
            )
            for index, info in metadata.storage_data.items()
            if index.fqn in keys
        ),
        key=lambda item: (item.file, item.offset),
    )


def _check_sizes(path: Path, items: list[_Item]) -> None:
    for file in sorted({item.file for item in items}):
        inside = [item for item in items if item.file == file]
        try:
            size = (path / file).stat().st_size
        except OSError as error:
            raise CheckpointError(
                f"checkpoint {path}: cannot read {file}, which holds {inside[0].key} "
                f"({describe_failure(error)}); {_NOTHING_LOADED}"
            ) from None
        cut = next((item for item in inside if item.end > size), None)
        if cut is not None:
            needed = max(item.end for item in inside)
            raise CheckpointError(
                f"checkpoint {path}: {file} is truncated: it holds {size} bytes, but the "
                f"checkpoint's metadata records {needed} bytes ({cut.key} at bytes {cut.offset}-"
                f"{cut.end}); the save or a copy of it was cut short; {_NOTHING_LOADED}"
            )


def _share(items: list[_Item], rank: int, world_size: int) -> list[_Item]:
    """This rank's items: the largest first to the least loaded rank (every rank computes the
    same split from the same metadata), so each rank reads about 1/world of the bytes."""
    loads = [0] * world_size
    mine = []
    for item in sorted(items, key=lambda i: (-i.length, i.file, i.offset)):
        owner = loads.index(min(loads))
        loads[owner] += item.length
        if owner == rank:
            mine.append(item)
    return mine


def _check_item(path: Path, item: _Item, handle: io.BufferedReader, data: memoryview) -> None:
    try:
        _check_archive(handle, data, item.offset, item.length)
    except Exception as error:
        raise CheckpointError(
            f"checkpoint {path}: {item.file} is corrupted: {item.key} (bytes {item.offset}-"
            f"{item.end}) does not read back as saved ({describe_failure(error)}); the file "
            f"changed after the save (disk, copy or transfer); {_NOTHING_LOADED}"
        ) from None


@contextmanager
def _mapped(file: Path) -> Iterator[tuple[io.BufferedReader, memoryview]]:
    """`file` open and mapped: CRC-32 runs over the mapped pages (no copy into Python)."""
    with open(file, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            raise zipfile.BadZipFile("the file is empty")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                yield handle, view
            finally:
                view.release()


def _check_archive(handle: io.BufferedReader, data: memoryview, offset: int, length: int) -> None:
    """Check the zip archive (torch.save's format) at `offset`: its directory parses, and each
    member's bytes match the CRC-32 recorded for it (raises zipfile.BadZipFile otherwise)."""
    with zipfile.ZipFile(ArchiveSlice(handle, offset, length)) as archive:  # reads the directory
        for member in archive.infolist():
            if member.compress_type != zipfile.ZIP_STORED:  # not torch's: zipfile checks it
                with archive.open(member) as stream:
                    while stream.read(_CHUNK):
                        pass
                continue
            at = offset + member.header_offset
            start = offset + data_start(data[at : at + LOCAL_HEADER_SIZE], length, member)
            # a member saved without a CRC-32 records 0: only its place can be checked
            if member.CRC != 0 and _crc32(data, start, member.file_size) != member.CRC:
                raise zipfile.BadZipFile(f"Bad CRC-32 for file {member.filename!r}")


def _crc32(data: memoryview, start: int, size: int) -> int:
    """CRC-32 of `size` bytes of the mapped file from `start`, a chunk at a time, each chunk's
    pages let go once summed: a mapped page read counts in the process's resident memory until
    unmapped, so checking a 79 MiB disk-table checkpoint this way raised the load's peak by 79
    MiB (the pages stay in the page cache for the load's own read)."""
    pages = data.obj
    crc = 0
    for at in range(start, start + size, _CRC_CHUNK):
        end = min(at + _CRC_CHUNK, start + size)
        crc = zlib.crc32(data[at:end], crc)
        if isinstance(pages, mmap.mmap):
            first = at - at % mmap.PAGESIZE
            pages.madvise(mmap.MADV_DONTNEED, first, end - first)
    return crc
