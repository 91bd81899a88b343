"""A load's reads into blocks with a write hook: through one reused buffer, then the hook.

DCP's readers fill the tensor the planner resolves for each read item. A disk table's blocks
are views of a map of its file, and filling them wrote each page through the map: the first
write of a page cost 35-84 us per 256-byte row against 7 us with pwrite, most of a 1 GB load
(docs/benchmarks.md). So for an item whose block has a `write` hook (local_shards.Block) the
planner hands the reader a buffer of the item's shape instead, and the commit hands the
buffer to the hook, which writes the file with pwrite. The buffer is reused, and an item is
at most one of the block's chunks (8 MiB for a disk table), so memory stays about a chunk
whatever the table's size. DCP documents this use of `commit_tensor`: a planner that cannot
hand out the state's own tensor copies the read values back there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from manualpar.checkpoint.local_shards import LocalShards

__all__ = ["BlockWrites"]


class BlockWrites:
    """Wraps a load planner: items of blocks with a write hook are read into a buffer and
    written by the hook at their commit; the rest, and every other call, go to `planner`."""

    def __init__(self, planner: LoadPlanner) -> None:
        self.planner = planner
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.planner, name)

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        target = self.planner.resolve_tensor(item)  # the block's prepare runs here
        if self._hook(item) is None:
            return target
        return self._buffer_like(target)

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        write = self._hook(item)
        if write is None:
            self.planner.commit_tensor(item, tensor)
        else:
            write(tuple(item.dest_offsets), tensor)

    def _hook(self, item: ReadItem) -> Callable[[Sequence[int], torch.Tensor], None] | None:
        """The write hook of the block `item` reads into, or None (the target takes it)."""
        state = getattr(self.planner, "state_dict", None)
        shards = state.get(item.dest_index.fqn) if isinstance(state, dict) else None
        if not isinstance(shards, LocalShards):
            return None
        return shards.block_at(item.dest_index).write

    def _buffer_like(self, target: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU tensor of `target`'s shape and dtype in the reused buffer."""
        size = target.numel() * target.element_size()
        if self._buffer.numel() < size:
            self._buffer = torch.empty(size, dtype=torch.uint8)
        return self._buffer[:size].view(target.dtype).view(target.shape)
