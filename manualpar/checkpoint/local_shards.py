"""LocalShards: the blocks of one global tensor that this rank holds, as DCP sees them.

torch.distributed.checkpoint saves and reshards any state-dict value implementing its
checkpointable protocol (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`, as DTensor does). DTensor itself cannot describe a table that lives whole
on one rank, or column blocks on a subset of ranks; this small class can describe any set of
rectangles, so a table saved under one plan or world size loads under any other. The blocks are
views of the live tensors: DCP reads into them in place.

`full_tensors()` switches state dicts to plain, gathered tensors (the `full=True` export); the
owner gathers them from `primary_sum()` with its strategy's all-reduce.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from manualpar.errors import CheckpointMismatchError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = [
    "Block",
    "LocalShards",
    "current_load",
    "full_tensors",
    "gathering_full_tensors",
    "loading",
]

_FULL = contextvars.ContextVar("manualpar_full_tensors", default=False)


@contextmanager
def full_tensors() -> Iterator[None]:
    """Inside, sharded embedding state dicts return full tensors (a collective per tensor)."""
    token = _FULL.set(True)
    try:
        yield
    finally:
        _FULL.reset(token)


def gathering_full_tensors() -> bool:
    return _FULL.get()


_LOAD: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "manualpar_loading", default=None
)


@contextmanager
def loading() -> Iterator[object]:
    """Inside (a checkpoint load), state dicts are taken to be loaded into: a store hands its
    blocks out as they are, without first making them whole (a disk table would generate and
    write every row it never wrote, for the load to overwrite). Yields the load's token."""
    token = object()
    reset = _LOAD.set(token)
    try:
        yield token
    finally:
        _LOAD.reset(reset)


def current_load() -> object | None:
    """The token of the load running (loading()), or None outside one."""
    return _LOAD.get()


@dataclass(frozen=True)
class Block:
    offsets: tuple[int, ...]
    tensor: torch.Tensor
    primary: bool = True  # False for extra replicas: only one rank contributes a replicated block
    # called before DCP reads or writes this block: a disk table's blocks are views of a mapped
    # file, and this lets go of the pages the previous block touched, so a checkpoint holds one
    # block's pages at a time instead of the whole file
    prepare: Callable[[], None] | None = None
    # where a background save stages its private copy of this block (a disk table's directory,
    # so the copy stays out of memory: checkpoint/spill.py), or None: in memory
    spill_dir: Path | None = None
    # how a load writes values into this block instead of copying them into `tensor`:
    # write(offsets within the block, values). A disk table's blocks are views of a mapped
    # file, whose first write of each page cost 5-12x a pwrite of the same bytes; its hook
    # writes the file itself (checkpoint/block_writes.py)
    write: Callable[[Sequence[int], torch.Tensor], None] | None = None

    def fill(self, values: torch.Tensor) -> None:
        """Set the whole block to `values` (converted to its dtype), through `write` if any."""
        if self.write is None:
            self.tensor.copy_(values)
        else:
            self.write((0,) * self.tensor.dim(), values.to(self.tensor.dtype))


class LocalShards(torch.Tensor):
    """This rank's blocks of a tensor of global `shape` (possibly none of them).

    A storage-less tensor subclass: DCP looks state-dict values up only if they are tensors, and
    then asks them for their blocks through the protocol below. Any other op raises.
    """

    blocks: list[Block]

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        blocks: Sequence[Block],
        dtype: torch.dtype,
    ) -> LocalShards:
        device = blocks[0].tensor.device if blocks else torch.device("cpu")
        self = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=dtype, device=device
        )
        self.blocks = list(blocks)
        return self

    # torch's stubs type these hooks as instance methods; tensor subclasses define them as here
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: object, types: object, args: object = (), kwargs: object = None
    ) -> None:
        raise NotImplementedError(
            f"{func}: a LocalShards value only describes this rank's blocks of a sharded tensor "
            "for checkpointing; read the module's parameters, or use full_tensors() for a "
            "gathered tensor"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        parts = ", ".join(f"{list(b.offsets)}+{list(b.tensor.shape)}" for b in self.blocks)
        return f"LocalShards(shape={list(self.shape)}, blocks=[{parts}])"

    # DCP checkpointable protocol ----------------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(block.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(block.offsets), sizes=block.tensor.shape
                    ),
                    properties=TensorProperties.create_from_tensor(block.tensor),
                    size=self.shape,
                ),
            )
            for block in self.blocks
            if block.primary  # one copy of a replicated block is written (the primary's)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=b.tensor.shape)
            for b in self.blocks
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        block = self.block_at(index)
        if block.prepare is not None:
            block.prepare()
        return block.tensor

    def block_at(self, index: MetadataIndex) -> Block:
        """The block DCP's `index` names (by its offsets in the whole tensor)."""
        for block in self.blocks:
            if index.offset is None or torch.Size(block.offsets) == index.offset:
                return block
        raise CheckpointMismatchError(
            f"{index.fqn}: this rank holds no block at offset {index.offset}"
        )

    # full tensors ---------------------------------------------------------------------------
    def primary_sum(self) -> torch.Tensor:
        """A tensor of the global shape holding this rank's primary blocks (zeros elsewhere):
        summed over ranks (one all-reduce, by the owner's strategy) it is the whole tensor."""
        full = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        for block in self.blocks:
            if block.primary:
                full[_region(block)] = block.tensor
        return full

    def copy_from_full(self, full: torch.Tensor, what: str) -> None:
        """Fill the local blocks from a full tensor (loading a full export)."""
        if tuple(full.shape) != tuple(self.shape):
            raise CheckpointMismatchError(
                f"{what}: a full tensor of shape {tuple(full.shape)} does not fit "
                f"shape {tuple(self.shape)}"
            )
        for block in self.blocks:
            block.fill(full[_region(block)])


def _region(block: Block) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(block.offsets, block.tensor.shape, strict=True))
