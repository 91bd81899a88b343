"""A background save's private copy of a disk table, kept in a file instead of memory.

A background save snapshots every tensor before training goes on (background.py). Copying a
disk table's block into memory would undo the tier's bound (the block is on disk because it
does not fit), so blocks that name a `spill_dir` are copied, chunk by chunk, into one
unlinked file there: it has no name from the start (nothing to clean up after a crash), its
space returns when the save lets go of the copy, and each chunk's pages are dropped before the
next one is copied or written, so a background save holds about one chunk in memory, as a
synchronous one does. It needs free space beside the table for the block's checkpointed bytes
until the save ends.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from manualpar.checkpoint.local_shards import Block

__all__ = ["spill_blocks"]


def spill_blocks(blocks: Sequence[Block], directory: Path) -> list[Block]:
    """Copies of `blocks` in one unlinked file under `directory`, as blocks whose `prepare`
    drops the copy's pages (read back by the save one chunk at a time)."""
    sizes = [b.tensor.numel() * b.tensor.element_size() for b in blocks]
    total = sum(sizes)
    if total == 0:
        return [Block(b.offsets, b.tensor.detach().clone(), b.primary) for b in blocks]
    fd, name = tempfile.mkstemp(prefix=".background-save-", dir=directory)
    try:
        os.unlink(name)  # nameless from now on: freed with the last reference to the map
        os.ftruncate(fd, total)
        pages = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the map keeps the file
    everything = torch.frombuffer(pages, dtype=torch.uint8)

    def drop_pages() -> None:
        pages.madvise(mmap.MADV_DONTNEED)  # written pages stay in the file (shared map)

    copies, start = [], 0
    for block, size in zip(blocks, sizes, strict=True):
        if block.prepare is not None:
            block.prepare()  # let go of the source's previous chunk
        drop_pages()
        tensor = block.tensor.detach()
        copy = everything[start : start + size].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(Block(block.offsets, copy, block.primary, drop_pages))
        start += size
    if blocks[-1].prepare is not None:
        blocks[-1].prepare()
    drop_pages()
    return copies
