"""The state-dict and load hooks of a sharded collection's tables.

A table's state-dict entry (`tables.<name>.weight`) is this rank's block as LocalShards of the
whole table (storage/table_blocks.py, `local_shards`), so a checkpoint reshards on load to any
plan or world size; under `full_tensors()` it is the whole table, summed over the ranks' blocks.
A load writes through the same blocks: a disk table's straight into its file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from manualpar.checkpoint.local_shards import LocalShards, gathering_full_tensors
from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.storage.table_blocks import TableBlock, TableBlocks, local_shards

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["TableHooks", "full_tensor"]


def full_tensor(strategy: ManualParallelStrategy) -> Callable[[LocalShards], torch.Tensor]:
    """The whole tensor of every rank's blocks (one all_reduce; collective): what a state dict
    holds under `full_tensors()`."""

    def gather(shards: LocalShards) -> torch.Tensor:
        return strategy.all_reduce_(
            shards.primary_sum(), "sum", name=f"{BUILDER}: gathering a full table"
        )

    return gather


class TableHooks:
    """Registered on each table module of `blocks`; `before_load` runs before a held block's
    rows are overwritten (batches sent ahead hold rows read before the load: they are
    dropped, and their forward then runs whole, on the loaded rows)."""

    def __init__(
        self,
        blocks: TableBlocks,
        primary_replica: bool,
        gather: Callable[[LocalShards], torch.Tensor],
        before_load: Callable[[], None],
    ) -> None:
        self.blocks, self.primary_replica = blocks, primary_replica
        self.gather, self.before_load = gather, before_load
        for block in blocks:
            block.table._register_state_dict_hook(self.state_dict_hook)
            block.table._register_load_state_dict_pre_hook(self.load_pre_hook)

    def shards(self, block: TableBlock) -> LocalShards:
        return local_shards(block, None, block.weight.dtype, self.primary_replica)

    def state_dict_hook(
        self, table: nn.Module, state_dict: dict, prefix: str, local_metadata: Any
    ) -> None:
        value = self.shards(self._block(prefix))
        state_dict[prefix + "weight"] = self.gather(value) if gathering_full_tensors() else value

    def load_pre_hook(self, state_dict: dict, prefix: str, *args: Any) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            return
        block = self._block(prefix)
        value, mine = state_dict[key], self.shards(block)
        if isinstance(value, LocalShards):
            for ours, theirs in zip(mine.blocks, value.blocks, strict=False):
                if theirs.tensor.data_ptr() != ours.tensor.data_ptr():
                    ours.tensor.copy_(theirs.tensor)
        else:
            mine.copy_from_full(value.to(block.weight.device), f"table {block.name!r}")
        if block.store is not None:
            self.before_load()
            block.store.loaded([None])  # the weights
        state_dict[key] = block.weight.detach()

    def _block(self, prefix: str) -> TableBlock:
        return self.blocks.by_name[prefix.rstrip(".").split(".")[-1]]
