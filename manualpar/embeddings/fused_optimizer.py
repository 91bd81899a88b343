"""FusedOptimizer: the state of a sharded collection's sparse optimizer, next to its rows.

It is not a torch Optimizer (nothing calls step(): updates happen in backward); it is a stateful
object for checkpoints. Save it with the model:

    strategy.save_checkpoint(path, {"model": model, "sparse_optim": emb.fused_optimizer, ...})

Its state dict holds one entry per table and state tensor, in the unsharded layout ((rows,) for
row-wise Adagrad, (rows, dim) for Adagrad/Adam), so it reshards like the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from manualpar.checkpoint.local_shards import Block, LocalShards, gathering_full_tensors
from manualpar.embeddings.plan import Shard
from manualpar.embeddings.shard_compute import BagGradients, RowPass, ShardBags
from manualpar.embeddings.update_rules import SparseOptimizer, check_lr

__all__ = ["FusedOptimizer"]


class FusedOptimizer:
    """A sharded collection's update rule, its per-table state and step count."""

    def __init__(
        self,
        rule: SparseOptimizer,
        shards: dict[str, Shard | None],
        dims: dict[str, int],
        rows: dict[str, int],
        device: torch.device,
        full_tensor: Callable[[LocalShards], torch.Tensor],
    ) -> None:
        self.rule = rule
        self.step = 0
        self._shards, self._dims, self._rows = shards, dims, rows
        self._full_tensor = full_tensor
        self.state: dict[str, dict[str, torch.Tensor]] = {
            name: rule.init_state(shard.rows, shard.cols, device)
            for name, shard in shards.items()
            if shard is not None
        }

    @property
    def optimizer(self) -> SparseOptimizer:
        """The update rule (its name before 0.2)."""
        return self.rule

    @property
    def lr(self) -> float:
        return self.rule.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.rule.lr = check_lr(value, "fused optimizer")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """For logging code that reads param_groups[0]["lr"]."""
        return [{"lr": self.lr}]

    # updates (inside backward) ----------------------------------------------------------------
    def _held(self, table: str) -> Shard:
        shard = self._shards.get(table)
        if shard is None:
            raise KeyError(f"table {table!r} has no block on this rank to update")
        return shard

    @torch.no_grad()
    def update_rows(
        self, table: str, weight: torch.Tensor, rows: torch.Tensor, summed: torch.Tensor
    ) -> None:
        """Apply the rule to distinct `rows` of this rank's block of `table`, given each row's
        summed gradient (full width for a column block if the rule needs full rows)."""
        shard = self._held(table)
        row_sq_mean = summed.square().mean(1) if self.rule.needs_full_rows else None
        if summed.shape[1] != shard.cols:  # full-width gradient of a column block
            summed = summed[:, shard.col_start : shard.col_end]
        self.rule.step_rows(weight, self.state[table], rows, summed, self.step, row_sq_mean)

    @torch.no_grad()
    def step_bags(
        self,
        table: str,
        weight: torch.Tensor,
        bags: ShardBags,
        grads: BagGradients,
        rows: RowPass,
    ) -> bool:
        """The rule's fused pass straight from the bags' gradients; False if it has none for
        these tensors (then sum row gradients and call `update_rows`)."""
        shard = self._held(table)
        return self.rule.step_bags(
            weight, self.state[table], bags, grads, shard.col_start, self.step, rows
        )

    def __repr__(self) -> str:
        return f"FusedOptimizer({self.rule.describe()}, tables={list(self.state)})"

    # checkpoint ---------------------------------------------------------------------------------
    def _shards_of(self, table: str, key: str) -> LocalShards:
        per_row = self.rule.STATE[key]
        shape = (self._rows[table],) if per_row else (self._rows[table], self._dims[table])
        shard = self._shards.get(table)
        if shard is None:  # no block of this table here: an entry without blocks
            return LocalShards(shape, [], torch.float32)
        tensor = self.state[table][key]
        primary = not shard.replicated or shard.rank == 0
        if per_row:  # column blocks all hold the same row statistics: one of them saves them
            primary = primary and shard.col_start == 0
            offsets: tuple[int, ...] = (shard.row_start,)
        else:
            offsets = (shard.row_start, shard.col_start)
        return LocalShards(shape, [Block(offsets, tensor, primary)], tensor.dtype)

    def state_dict(self) -> dict[str, Any]:
        shards = {
            table: {key: self._shards_of(table, key) for key in self.rule.STATE}
            for table in self._rows
        }
        state: dict[str, dict[str, torch.Tensor]] = {t: dict(keys) for t, keys in shards.items()}
        if gathering_full_tensors():
            state = {
                table: {key: self._full_tensor(value) for key, value in keys.items()}
                for table, keys in shards.items()
            }
        return {"lr": self.lr, "step": self.step, "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lr = state_dict["lr"]
        self.step = int(state_dict["step"])
        for table in self._rows:
            for key in self.rule.STATE:
                value = state_dict["state"][table][key]
                mine = self._shards_of(table, key)
                if isinstance(value, LocalShards):
                    for block, theirs in zip(mine.blocks, value.blocks, strict=True):
                        if block.tensor.data_ptr() != theirs.tensor.data_ptr():
                            block.tensor.copy_(theirs.tensor)
                else:
                    mine.copy_from_full(
                        value.to(mine.device), f"sparse optimizer state {table}/{key}"
                    )
