"""A background save's private copy of a disk table, kept in a file instead of memory.

A background save snapshots every tensor before training goes on (background.py). Copying a
disk table's block into memory would undo the tier's bound (the block is on disk because it
does not fit), so blocks that name a `spill_dir` are copied, chunk by chunk, into one
unlinked file there: it has no name from the start (nothing to clean up after a crash), its
space returns when the save lets go of the copy, and each chunk's pages are dropped before the
next one is copied or written, so a background save holds about one chunk in memory, as a
synchronous one does. Each copy is a storage of its own over its part of the map: DCP's writer
clones a tensor that views a larger storage, and those 8 MiB heap copies, made on the writer
thread under the step's malloc thresholds (heap.py), stayed mapped: 3 background saves of a
79 MB disk block grew the peak RSS by 124-165 MiB, and by 0 with a storage per copy.

It needs free space beside the table for the block's checkpointed bytes until the save ends:
checked for all of a rank's copies before the first is made, and the file is reserved
(fallocate), so a full file system is a CheckpointError naming the bytes, never a SIGBUS in the
copy's writes to a map of a file that cannot grow.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from manualpar.checkpoint.local_shards import Block
from manualpar.errors import CheckpointError

__all__ = ["check_room", "spill_blocks"]


def check_room(blocks: Iterable[Block]) -> None:
    """Refuse, before any copy is made, a background save whose copies of the blocks that name
    a `spill_dir` do not fit the free space there."""
    needed: dict[Path, int] = defaultdict(int)
    for block in blocks:
        if block.spill_dir is not None:
            needed[block.spill_dir] += _nbytes(block)
    for directory, size in needed.items():
        free = shutil.disk_usage(directory).free
        if free < size:
            raise _no_room(directory, size, f"{_size(free)} are free")


def spill_blocks(blocks: Sequence[Block], directory: Path) -> list[Block]:
    """Copies of `blocks` in one unlinked file under `directory`, as blocks whose `prepare`
    drops the copy's pages (read back by the save one chunk at a time)."""
    sizes = [_nbytes(b) for b in blocks]
    total = sum(sizes)
    if total == 0:
        return [Block(b.offsets, b.tensor.detach().clone(), b.primary) for b in blocks]
    fd, name = tempfile.mkstemp(prefix=".background-save-", dir=directory)
    try:
        os.unlink(name)  # nameless from now on: freed with the last reference to the map
        try:
            os.posix_fallocate(fd, 0, total)  # room taken now: a map of a sparse file on a
        except OSError as error:  # full file system meets SIGBUS when written
            raise _no_room(directory, total, f"reserving it failed ({error.strerror})") from None
        pages = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the map keeps the file

    def drop_pages() -> None:
        pages.madvise(mmap.MADV_DONTNEED)  # written pages stay in the file (shared map)

    copies, start = [], 0
    for block, size in zip(blocks, sizes, strict=True):
        if block.prepare is not None:
            block.prepare()  # let go of the source's previous chunk
        drop_pages()
        tensor = block.tensor.detach()
        # a storage of its own: DCP's writer clones a view of a larger storage, on the heap
        own = torch.frombuffer(pages, dtype=torch.uint8, count=size, offset=start)
        copy = own.view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(Block(block.offsets, copy, block.primary, drop_pages))
        start += size
    if blocks[-1].prepare is not None:
        blocks[-1].prepare()
    drop_pages()
    return copies


def _nbytes(block: Block) -> int:
    return block.tensor.numel() * block.tensor.element_size()


def _no_room(directory: Path, needed: int, why: str) -> CheckpointError:
    return CheckpointError(
        f"save_checkpoint_async: no room for the copy of this rank's disk tables: a background "
        f"save copies their blocks into {str(directory)!r} (the disk tier's directory) until it "
        f"is written, which needs {_size(needed)} there, and {why}; free disk space there, or "
        "save with save_checkpoint (synchronous: it makes no copy)"
    )


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB ({count} bytes)"
