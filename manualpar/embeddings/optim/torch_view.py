"""The fused optimizer's torch view: its param group and state by parameter follow the tables.

torch's optimizers keep the Parameters they were given. The fused optimizer updates whatever
its tables hold (storage/table_blocks.py), so its torch view does too: `param_groups[0]
["params"]` and `state` hold each block's weight as its table holds it when they are read. A
weight replaced since the last step (`emb.tables[name].weight = nn.Parameter(...)`) is there at
once, with the old one's owner marks, not only from the next step on (before, whatever read
them in between, a user or a hook, saw the old Parameter). A replacement the next step
refuses (another shape, dtype or device, a disk tier's row cache: step/weight_guard.py) is
shown as well: the tables hold it, and the step raises.

Reading them costs an identity check a table (about 0.1 us); the update reads its learning rate
and device without it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from manualpar.embeddings.storage.table_blocks import TableBlocks
from manualpar.ownership import claim, mesh_of, owner_of, trained_by_owner

__all__ = ["TorchView"]


class TorchView(torch.optim.Optimizer):
    """A torch optimizer whose one param group holds the weights of `_blocks`' tables."""

    _blocks: TableBlocks
    table_state: dict[str, dict[str, torch.Tensor]]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """torch's param groups: one, holding the blocks' weights as the tables hold them now."""
        self.follow_tables()
        return self._groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.__dict__["param_groups"] = groups

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        """torch's state by parameter: each held block's weight, as its table holds it now, to
        the table's state tensors."""
        self.follow_tables()
        return self.__dict__["state"]

    @state.setter
    def state(self, state: defaultdict[torch.Tensor, Any]) -> None:
        self.__dict__["state"] = state

    @property
    def _groups(self) -> list[dict[str, Any]]:
        """The param groups as they are, not followed (the update's reads)."""
        return self.__dict__["param_groups"]

    def follow_tables(self) -> None:
        """Take the tables' weights into the view where one was replaced since (reading the
        view does; `ParallelModule.dense_parameters()` does through the sharded collection)."""
        blocks, groups = self.__dict__.get("_blocks"), self.__dict__.get("param_groups")
        if blocks is None or not groups:  # still in torch's __init__
            return
        for before, block in zip(groups[0]["params"], blocks, strict=True):
            if block.table._parameters.get("weight") is not before:
                self.weights_replaced()
                return

    def weights_replaced(self) -> None:
        """The view (the param group, the state by parameter) of the blocks' weights as the
        tables hold them now: reading the view calls it, and the step where a weight was
        replaced by one of the same shape and dtype (step/weight_guard.py), which then frees the
        old block. A new Parameter takes the old one's owner marks, so `dense_parameters()`
        leaves it out as before."""
        group = self._groups[0]
        for before, block in zip(group["params"], self._blocks, strict=True):
            builder = owner_of(before)
            if block.weight is not before and builder is not None:
                now = [("weight", block.weight)]
                trains_itself = trained_by_owner(before)
                mesh = mesh_of(before)
                claim(
                    block.table,
                    builder,
                    now,
                    trains_itself=trains_itself,
                    mesh=mesh,
                    take_module=False,
                )
        group["params"] = [block.weight for block in self._blocks]
        state = self.__dict__["state"]
        state.clear()
        for block in self._blocks.held():
            state[block.weight] = self.table_state[block.name]
