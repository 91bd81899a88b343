"""FusedOptimizer: a sharded collection's sparse optimizer, its state next to its rows.

The update happens inside backward, so nothing needs `step()`; it is a `torch.optim.Optimizer`
so that torch's learning-rate schedulers drive it. Its one param group holds this rank's block of
every table (`param_names` are the table names) and the `lr` that the update reads at the start
of every backward:

    scheduler = torch.optim.lr_scheduler.StepLR(emb.fused_optimizer, step_size=100)
    loss.backward()      # the tables are updated here, with param_groups[0]["lr"]
    dense_opt.step()
    scheduler.step()     # no warning: the backward counts as the optimizer's step

`step(closure)` only evaluates the closure (whose backward updates the tables) and `zero_grad()`
has no gradients to clear: the update never forms `.grad`. Save it with the model:

    strategy.save_checkpoint(path, {"model": model, "sparse_optim": emb.fused_optimizer, ...})

Its state dict ("lr", "step", "state") holds one entry per table and state tensor, in the
unsharded layout ((rows,) for row-wise Adagrad, (rows, dim) for Adagrad/Adam), so it reshards
like the weights; the checkpoint saves it as a stateful object (`saves_own_state`), not through
torch's per-parameter optimizer state dict.

Its torch view (`param_groups`, `state` by parameter) follows the tables: a weight replaced
since the last step is in it as soon as it is read (torch_view.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from manualpar import deprecated
from manualpar.checkpoint.local_shards import LocalShards, gathering_full_tensors
from manualpar.embeddings.kernels.bags import BagGradients, RowPass, ShardBags
from manualpar.embeddings.kernels.rounding import HALF_DTYPES, RowRounding
from manualpar.embeddings.kernels.table_batch import TableBatch
from manualpar.embeddings.optim.row_clipping import clip_coefficient, clip_rows
from manualpar.embeddings.optim.torch_view import TorchView
from manualpar.embeddings.optim.update_rules import UpdateRule, check_lr
from manualpar.embeddings.plan import Shard
from manualpar.embeddings.storage.table_blocks import TableBlocks, local_shards
from manualpar.embeddings.storage.tier import RowStore
from manualpar.errors import BuilderError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from manualpar.strategy import ManualParallelStrategy

__all__ = ["FusedOptimizer"]

# (table, this rank's block, distinct local rows, their summed gradients)
_RowUpdate = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]


class FusedOptimizer(TorchView):
    """A sharded collection's update rule, its per-table state and update count."""

    # checkpoints take state_dict() as is (tables' blocks), not torch's per-parameter layout
    saves_own_state = True
    # its parameters are the ones it updates (in backward): the step pre-hook's "an optimizer
    # holds self-updating parameters" warning (manualpar/module.py) is not for it
    updates_own_parameters = True

    def __init__(
        self,
        rule: UpdateRule,
        blocks: TableBlocks,
        full_tensor: Callable[[LocalShards], torch.Tensor],
        *,
        primary_replica: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__([(block.name, block.weight) for block in blocks], {"lr": rule.lr})
        self.rule = rule
        self.num_updates = 0  # backwards taken (Adam's bias correction counts them)
        self._blocks = blocks  # each table's shard, state and store (storage/table_blocks.py)
        self._full_tensor = full_tensor
        self._primary_replica = primary_replica  # 2-D: the first replica's state is saved
        self._seed = seed  # the collection's: half rows' stochastic rounding streams (rounding.py)
        self.table_state: dict[str, dict[str, torch.Tensor]] = {
            block.name: block.state for block in blocks if block.state is not None
        }
        # where each block's rows live (storage/tier.py): a disk table's state is its cache's
        # (checkpoints read the file)
        self.stores: dict[str, RowStore] = {
            block.name: block.store for block in blocks if block.store is not None
        }
        for block in blocks.held():  # torch's view: state by parameter
            self.state[block.weight] = self.table_state[block.name]
        self._deferred: list[_RowUpdate] | None = None
        # made once per table set, not every step: step_tables' column starts and states (by
        # the identity of its lists), and each half table's rounding of the current update
        self._batch_args: tuple[list[str], list[int], list[int], list[Any]] | None = None
        self._roundings: dict[str, tuple[int, torch.Tensor | None, dict[str, RowRounding]]] = {}

    @property
    def optimizer(self) -> UpdateRule:
        """Deprecated: the update rule's name before 0.2 (`rule`)."""
        deprecated.warn_deprecated("FusedOptimizer.optimizer")
        return self.rule

    @property
    def lr(self) -> float:
        """The learning rate the next backward applies: `param_groups[0]["lr"]`."""
        where = "fused optimizer: param_groups[0]['lr'] (set by a scheduler or by hand)"
        return check_lr(_as_float(self._groups[0]["lr"]), where)

    @lr.setter
    def lr(self, value: float) -> None:
        self._groups[0]["lr"] = check_lr(value, "fused optimizer")

    @property
    def needs_full_rows(self) -> bool:
        """Whether column blocks get full-width row gradients (row-wise statistics, row norms)."""
        return self.rule.needs_full_rows or self.rule.max_row_grad_norm is not None

    @property
    def fuses_bags(self) -> bool:
        """Whether the rule's fused pass runs (clipping needs the row sums first)."""
        return self.rule.fuses_bags and not self.rule.clips

    # torch.optim.Optimizer ---------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """No update here: each backward has applied its own. Evaluates `closure` if given
        (its backward updates the tables) and returns its loss, as torch optimizers do."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.param_groups:
            raise BuilderError(
                "FusedOptimizer has one param group, the collection's tables, updated by one "
                "rule; other parameters need their own torch optimizer"
            )
        # torch's add_param_group is wrapped to stay out of torch.compile graphs, a wrapper that
        # imports torch._dynamo at its first call: about 0.5 s of each rank's shard_embeddings
        # (docs/benchmarks.md, "Import time"). This optimizer is built eagerly in setup, never
        # inside a compiled graph, so the group is added by the function the wrapper holds.
        add = torch.optim.Optimizer.add_param_group
        getattr(add, "__wrapped__", add)(self, param_group)

    # updates (inside backward) ----------------------------------------------------------------
    def begin_update(self) -> None:
        """At the start of each backward: read the scheduled lr, count the update."""
        self.rule.lr = self.lr
        self.num_updates += 1
        # the attribute torch's schedulers check to warn of a scheduler step before any
        # optimizer step: this backward is that step
        self._opt_called = True
        self._deferred = [] if self.rule.max_grad_norm is not None else None

    def _held(self, table: str) -> Shard:
        block = self._blocks.by_name.get(table)
        shard = block.shard if block is not None else None
        if shard is None:
            raise KeyError(f"table {table!r} has no block on this rank to update")
        return shard

    @torch.no_grad()
    def update_rows(
        self, table: str, weight: torch.Tensor, rows: torch.Tensor, summed: torch.Tensor
    ) -> None:
        """Apply the rule to distinct `rows` of this rank's block of `table`, given each row's
        summed gradient (full width for a column block if `needs_full_rows`). Under global
        clipping the update waits for `finish_update`, which knows the total norm."""
        self._held(table)
        if self.rule.max_row_grad_norm is not None:
            summed = clip_rows(summed, self.rule.max_row_grad_norm)
        if self._deferred is not None:
            self._deferred.append((table, weight, rows, summed))
        else:
            self._apply(table, weight, rows, summed)

    def _apply(
        self, table: str, weight: torch.Tensor, rows: torch.Tensor, summed: torch.Tensor
    ) -> None:
        shard = self._held(table)
        row_sq_mean = summed.square().mean(1) if self.rule.needs_full_rows else None
        if summed.shape[1] != shard.cols:  # full-width gradient of a column block
            summed = summed[:, shard.col_start : shard.col_end]
        self.rule.step_rows(
            weight,
            self.table_state[table],
            rows,
            summed,
            self.num_updates,
            row_sq_mean,
            **self._rounding(table, weight),
        )

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
        these tensors, or clips (then sum row gradients and call `update_rows`)."""
        shard = self._held(table)
        if not self.fuses_bags:
            return False
        return self.rule.step_bags(
            weight,
            self.table_state[table],
            bags,
            grads,
            shard.col_start,
            self.num_updates,
            rows,
            **self._rounding(table, weight),
        )

    @property
    def batches_tables(self) -> bool:
        """Whether the rule's fused pass runs over many tables' float rows in one call
        (`step_tables`)."""
        return self.fuses_bags and self.rule.batches_tables

    @torch.no_grad()
    def step_tables(
        self,
        tables: list[str],
        weights: list[torch.Tensor],
        batch: TableBatch,
        grads: BagGradients,
        widths: list[int],
        rows: RowPass,
    ) -> None:
        """`step_bags` over the float rows of `tables` (each table's bags a run of `batch`,
        kernels/table_batch.py) in one call; `widths`: each table's gradient width (full
        width for a column block)."""
        if not self.batches_tables:
            raise BuilderError(
                f"{self.rule.describe()} has no table-batched update; its tables take step_bags"
            )
        found = self._batch_args
        if found is None or found[0] is not tables or found[1] is not widths:
            shards = [self._held(table) for table in tables]
            col_starts = [
                shard.col_start if width != shard.cols else 0
                for shard, width in zip(shards, widths, strict=True)
            ]
            states = [self.table_state[table] for table in tables]
            found = self._batch_args = (tables, widths, col_starts, states)
        _, _, col_starts, states = found
        self.rule.step_tables(weights, states, batch, grads, widths, col_starts, rows)

    def _rounding(self, table: str, weight: torch.Tensor) -> dict[str, RowRounding]:
        """The `rounding` argument of this update of half rows (none for float32 ones, so rules
        written before half rows keep working)."""
        if weight.dtype not in HALF_DTYPES:
            return {}
        slot_rows = self.stores[table].slot_rows  # draw by the rows the slots hold
        found = self._roundings.get(table)  # both passes of an update draw the same stream
        if found is not None and found[0] == self.num_updates and found[1] is slot_rows:
            return found[2]
        shard = self._held(table)
        offsets = (shard.row_start, shard.col_start)
        rounding = {
            "rounding": RowRounding.for_block(
                weight.dtype,
                self._seed,
                table,
                self.num_updates,
                offsets,
                self._blocks.by_name[table].config.embedding_dim,
                slot_rows,
            )
        }
        self._roundings[table] = (self.num_updates, slot_rows, rounding)
        return rounding

    @torch.no_grad()
    def finish_update(
        self, strategy: ManualParallelStrategy, group: DeviceMesh | None = None
    ) -> None:
        """At the end of each backward, on every rank: under global clipping, sum the squared
        gradients over the ranks of `group` (one all_reduce; the shard group of 2-D tables,
        whose replicas hold the same summed gradients), scale and apply the deferred rows."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        assert self.rule.max_grad_norm is not None
        square = torch.zeros((), dtype=torch.float64, device=self._device())
        for table, _, _, summed in deferred:
            square += self._norm_share(table, summed)
        strategy.all_reduce_(
            square, "sum", name="shard_embeddings: gradient norm all_reduce", group=group
        )
        scale = clip_coefficient(square.sqrt(), self.rule.max_grad_norm)
        for table, weight, rows, summed in deferred:
            self._apply(table, weight, rows, summed * scale.to(summed.dtype))

    def _norm_share(self, table: str, summed: torch.Tensor) -> torch.Tensor:
        """This rank's part of the squared norm: its columns of a column block, and a
        replicated table's rows on rank 0 only, so every element counts once."""
        shard = self._held(table)
        if shard.replicated and shard.rank != 0:
            return summed.new_zeros((), dtype=torch.float64)
        if summed.shape[1] != shard.cols:
            summed = summed[:, shard.col_start : shard.col_end]
        return summed.double().square().sum()

    def _device(self) -> torch.device:
        return self._groups[0]["params"][0].device

    def __repr__(self) -> str:
        return f"FusedOptimizer({self.rule.describe()}, tables={list(self.table_state)})"

    # checkpoint ---------------------------------------------------------------------------------
    def _shards_of(self, table: str, key: str) -> LocalShards:
        block, per_row = self._blocks.by_name[table], self.rule.STATE[key]
        return local_shards(block, key, torch.float32, self._primary_replica, per_row)

    def state_dict(self) -> dict[str, Any]:
        shards = {
            table: {key: self._shards_of(table, key) for key in self.rule.STATE}
            for table in self._blocks.by_name
        }
        state: dict[str, dict[str, torch.Tensor]] = {t: dict(keys) for t, keys in shards.items()}
        if gathering_full_tensors():
            state = {
                table: {key: self._full_tensor(value) for key, value in keys.items()}
                for table, keys in shards.items()
            }
        return {"lr": self.lr, "step": self.num_updates, "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lr = state_dict["lr"]
        self.num_updates = int(state_dict["step"])
        for table in self._blocks.by_name:
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
        for store in self.stores.values():
            store.loaded(list(self.rule.STATE))


def _as_float(value: object) -> object:
    """A learning rate as a number (torch allows one-element tensors in param groups)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value
