"""Reading a saved tensor straight into its target: one read from the file, nothing in between.

torch.distributed.checkpoint's reader loads each saved tensor into a new tensor (torch.load)
and copies that into the state: fresh memory to fault in and two copies of every byte. On a
load from the page cache that was most of the load (36 tensors of 4 MiB: 155 ms through DCP's
reader, 25 ms read straight into the targets, one process on a loaded 2-core machine). So a
plain read (a CPU target of the saved dtype and byte order taking a contiguous range of the
saved tensor) reads the saved bytes into the target: one read into a contiguous target, blocks
through one reused buffer into a strided one (a disk table's rows); anything else goes through
DCP's reader as before. Nothing here checks the bytes: the load checked every file first.
"""

from __future__ import annotations

import ctypes
import io
import os
import sys
import zipfile
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from manualpar.checkpoint.archive import LOCAL_HEADER_SIZE, ArchiveSlice, data_start

__all__ = ["MIN_DIRECT_BYTES", "read_into_target"]

# Smaller items go through DCP's reader: the archive's directory is parsed twice here (zipfile
# for the layout of its members, torch.load for the tensor's), which costs more than the copy
# it saves on a small tensor.
MIN_DIRECT_BYTES = 64 << 10
_BLOCK_BYTES = 8 << 20  # a strided target's reads: as the file check's chunks


@dataclass(frozen=True)
class _Saved:
    """A saved tensor's layout (a meta tensor: dtype, size, strides, storage offset) and where
    its storage's first byte lies in the file."""

    meta: torch.Tensor
    start: int


def read_into_target(
    stream: io.BufferedIOBase, info: Any, item: ReadItem, planner: LoadPlanner
) -> bool:
    """Read `item` (stored at `info`: file, offset, length) straight into its target and commit
    it; False, with nothing read, when it is not a plain read (DCP's reader takes it then)."""
    if item.type != LoadItemType.TENSOR or info.transform_descriptors:
        return False
    if info.length < MIN_DIRECT_BYTES:
        return False
    if os.fstat(stream.fileno()).st_size < info.offset + info.length:
        raise EOFError  # cut after the check: what DCP's reader reports too
    saved = _saved(stream, info.offset, info.length)
    if saved is None:
        return False
    region = _narrow(saved.meta, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if not _plain(region, target):
        return False
    at = saved.start + int(region.storage_offset()) * region.element_size()
    if target.is_contiguous():
        _read_exactly(stream, target, at)
    else:
        _read_in_blocks(stream, target, at)
    planner.commit_tensor(item, target)
    return True


def _saved(stream: io.BufferedIOBase, offset: int, length: int) -> _Saved | None:
    """The layout of the tensor saved at `offset`, or None unless it is one stored storage in
    this machine's byte order (then only DCP's reader knows how to read it)."""
    view = ArchiveSlice(stream, offset, length)
    with zipfile.ZipFile(view) as archive:
        storages = [m for m in archive.infolist() if "/data/" in m.filename]
        if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED:
            return None
        order = [name for name in archive.namelist() if name.endswith("/byteorder")]
        if order and archive.read(order[0]).decode() != sys.byteorder:
            return None
        member = storages[0]
        view.seek(member.header_offset)
        first = data_start(view.read(LOCAL_HEADER_SIZE), length, member)
    view.seek(0)
    # a meta load reads the archive's directory and pickle, no tensor data
    meta = torch.load(cast(IO[bytes], view), map_location="meta", weights_only=True)
    if type(meta) is not torch.Tensor or meta.untyped_storage().nbytes() != member.file_size:
        return None
    return _Saved(meta, offset + first)


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of the saved tensor that `item` reads (a view; the meta tensor has no data)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def _plain(region: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether `region`'s bytes are `target`'s values in order (row-major), so reads fill it."""
    return (
        target.device.type == "cpu"
        and target.dtype == region.dtype
        and target.shape == region.shape
        and region.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and (region.storage_offset() + region.numel()) * region.element_size()
        <= region.untyped_storage().nbytes()
    )


def _read_in_blocks(stream: io.BufferedIOBase, target: torch.Tensor, at: int) -> None:
    """Fill a strided target (a disk table's rows, each beside its optimizer state in the
    table's file) a block of rows at a time through one reused buffer: the copy DCP's reader
    makes too, without a temporary tensor of the whole size to allocate and fault in."""
    row = target[0].numel() * target.element_size() if len(target) else 0
    rows = max(1, _BLOCK_BYTES // max(row, 1))
    buffer = torch.empty((min(rows, len(target)), *target.shape[1:]), dtype=target.dtype)
    for first in range(0, len(target), rows):
        part = target[first : first + rows]
        block = buffer[: len(part)]
        _read_exactly(stream, block, at + first * row)
        part.copy_(block)


def _read_exactly(stream: io.BufferedIOBase, target: torch.Tensor, at: int) -> None:
    """Fill `target`'s memory with the file's bytes from `at` (EOFError if the file ends)."""
    size = target.numel() * target.element_size()
    if size == 0:
        return
    memory = memoryview((ctypes.c_char * size).from_address(target.data_ptr())).cast("B")
    stream.seek(at)
    done = 0
    while done < size:
        read = stream.readinto(memory[done:])
        if not read:
            raise EOFError
        done += read
