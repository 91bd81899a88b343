"""Fused sparse optimizers: applied to the looked-up rows inside backward.

A table's gradient is never formed densely: backward sums the gradient of each distinct id into
one row and the optimizer updates exactly those rows and their state. The rules match torch's
sparse optimizers on a coalesced sparse gradient (SGD, Adagrad, SparseAdam), and FBGEMM's
row-wise Adagrad, whose state is one float per row: the running sum of the mean over the row's
columns of the squared gradient (the unsharded definition, also under column-wise sharding).

Every rule can clip the table gradient before it is applied (row_clipping.py): each row's summed
gradient to `max_row_grad_norm`, and/or the whole collection's gradient to `max_grad_norm`
(as torch.nn.utils.clip_grad_norm_, over every table on every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from manualpar.embeddings.kernels.bags import BagGradients, RowPass, ShardBags, add_to_rows
from manualpar.embeddings.kernels.rounding import RowRounding
from manualpar.embeddings.kernels.row_memory import empty_rows, zeros_rows
from manualpar.embeddings.kernels.table_batch import TableBatch
from manualpar.embeddings.optim.fused_rowwise import rowwise_adagrad_fused, rowwise_adagrad_tables
from manualpar.embeddings.optim.row_clipping import check_max_norm
from manualpar.errors import BuilderError

__all__ = ["SGD", "Adagrad", "Adam", "RowWiseAdagrad", "UpdateRule", "check_lr"]


def check_lr(value: object, where: str) -> float:
    """A learning rate: a finite number >= 0 (a typo here would train silently on garbage)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value >= 0)
    ):
        raise BuilderError(f"{where}: lr must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_positive(value: object, name: str, where: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise BuilderError(f"{where}: {name} must be a finite number > 0, got {value!r}")


@dataclass
class UpdateRule:
    """Base of the update rules (how a row changes given its gradient). `lr` is the initial
    learning rate; once sharded, the fused optimizer's `param_groups[0]["lr"]` (what torch's
    schedulers set) is read at every backward.

    `max_row_grad_norm` clips each row's summed gradient to that L2 norm, `max_grad_norm` the
    L2 norm of all the collection's table gradients together (one all_reduce per backward);
    both keyword-only, None (the default) for no clipping, both may be set (rows first).
    """

    lr: float
    max_row_grad_norm: float | None = field(default=None, kw_only=True)
    max_grad_norm: float | None = field(default=None, kw_only=True)

    # one entry per state tensor: name -> per-row (True: one float per row) or per-element
    STATE: ClassVar[dict[str, bool]] = {}
    # the update needs the gradient's full width (row-wise statistics under column sharding)
    needs_full_rows: ClassVar[bool] = False
    # has a fused `step_bags` (it needs the rows grouped in forward)
    fuses_bags: ClassVar[bool] = False
    # has `step_tables`: the fused pass over many tables' float rows in one call
    batches_tables: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.lr = check_lr(self.lr, type(self).__name__)
        check_max_norm(self.max_row_grad_norm, "max_row_grad_norm", type(self).__name__)
        check_max_norm(self.max_grad_norm, "max_grad_norm", type(self).__name__)
        if hasattr(self, "eps"):
            _check_positive(self.eps, "eps", type(self).__name__)

    def init_state(
        self, rows: int, cols: int, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        return {
            name: zeros_rows(rows, device=device)
            if per_row
            else zeros_rows(rows, cols, device=device)
            for name, per_row in self.STATE.items()
        }

    def step_rows(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        row_sq_mean: torch.Tensor | None,
        rounding: RowRounding | None = None,
    ) -> None:
        """Update `weight[rows]` (and state) given each row's summed gradient `grad`.

        `rows` are distinct local row indices; `row_sq_mean` is the mean over the table's full
        width of the squared gradient (only for optimizers with `needs_full_rows`); half rows
        compute in float32 and round back by `rounding` (rounding.py).
        """
        raise NotImplementedError

    def step_bags(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        bags: ShardBags,
        grads: BagGradients,
        col_start: int,
        step: int,
        rows: RowPass,
        rounding: RowRounding | None = None,
    ) -> bool:
        """Update the `rows` of this pass straight from the bags' gradients (full width if
        `needs_full_rows`) in one fused pass, if this rule has such a kernel for these tensors;
        False: not done, the caller sums row gradients (once all have come) and calls
        `step_rows`."""
        return False

    def step_tables(
        self,
        weights: list[torch.Tensor],
        states: list[dict[str, torch.Tensor]],
        batch: TableBatch,
        grads: BagGradients,
        widths: list[int],
        col_starts: list[int],
        rows: RowPass,
    ) -> None:
        """`step_bags` over every table of a table batch (kernels/table_batch.py) in one call,
        for rules with `batches_tables` (the step asks before it batches any table)."""
        raise NotImplementedError(f"{type(self).__name__} has no table-batched update")

    @property
    def clips(self) -> bool:
        return self.max_row_grad_norm is not None or self.max_grad_norm is not None

    def describe(self) -> str:
        clipping = "".join(
            f", {name}={value}"
            for name, value in (
                ("max_row_grad_norm", self.max_row_grad_norm),
                ("max_grad_norm", self.max_grad_norm),
            )
            if value is not None
        )
        return f"{type(self).__name__}(lr={self.lr}{clipping})"


@dataclass
class SGD(UpdateRule):
    """Plain SGD on the looked-up rows (no state)."""

    def step_rows(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        row_sq_mean: torch.Tensor | None,
        rounding: RowRounding | None = None,
    ) -> None:
        add_to_rows(weight, rows, grad, -self.lr, rounding)


@dataclass
class Adagrad(UpdateRule):
    """torch.optim.Adagrad on sparse gradients (lr_decay=0, weight_decay=0)."""

    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    STATE = {"sum": False}

    def init_state(
        self, rows: int, cols: int, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        return {"sum": empty_rows(rows, cols, device=device).fill_(self.initial_accumulator_value)}

    def step_rows(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        row_sq_mean: torch.Tensor | None,
        rounding: RowRounding | None = None,
    ) -> None:
        total = state["sum"].index_select(0, rows).addcmul_(grad, grad)
        state["sum"].index_copy_(0, rows, total)
        add_to_rows(weight, rows, grad / total.sqrt_().add_(self.eps), -self.lr, rounding)


@dataclass
class RowWiseAdagrad(UpdateRule):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row (the mean squared gradient)."""

    eps: float = 1e-10
    STATE = {"sum": True}
    needs_full_rows = True
    fuses_bags = True
    batches_tables = True

    def step_rows(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        row_sq_mean: torch.Tensor | None,
        rounding: RowRounding | None = None,
    ) -> None:
        assert row_sq_mean is not None  # needs_full_rows: the caller computes it
        total = state["sum"].index_select(0, rows).add_(row_sq_mean)
        state["sum"].index_copy_(0, rows, total)
        scale = (1 / total.sqrt_().add_(self.eps)).unsqueeze(1)
        add_to_rows(weight, rows, grad * scale, -self.lr, rounding)

    def step_bags(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        bags: ShardBags,
        grads: BagGradients,
        col_start: int,
        step: int,
        rows: RowPass,
        rounding: RowRounding | None = None,
    ) -> bool:
        return rowwise_adagrad_fused(
            weight, state["sum"], bags, grads, col_start, rows, self.lr, self.eps, rounding
        )

    def step_tables(
        self,
        weights: list[torch.Tensor],
        states: list[dict[str, torch.Tensor]],
        batch: TableBatch,
        grads: BagGradients,
        widths: list[int],
        col_starts: list[int],
        rows: RowPass,
    ) -> None:
        rowwise_adagrad_tables(
            weights,
            [state["sum"] for state in states],
            batch,
            grads,
            widths,
            col_starts,
            rows,
            self.lr,
            self.eps,
        )


@dataclass
class Adam(UpdateRule):
    """Lazy Adam, as torch.optim.SparseAdam: moments and weights of the looked-up rows only;
    bias correction uses the number of steps taken (one per backward)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    STATE = {"exp_avg": False, "exp_avg_sq": False}

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.betas) != 2 or not all(
            isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas
        ):
            raise BuilderError(f"Adam: betas must be two numbers in [0, 1), got {self.betas!r}")

    def step_rows(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        row_sq_mean: torch.Tensor | None,
        rounding: RowRounding | None = None,
    ) -> None:
        beta1, beta2 = self.betas
        exp_avg = state["exp_avg"].index_select(0, rows).lerp_(grad, 1 - beta1)
        exp_avg_sq = (
            state["exp_avg_sq"]
            .index_select(0, rows)
            .mul_(beta2)
            .addcmul_(grad, grad, value=1 - beta2)
        )
        state["exp_avg"].index_copy_(0, rows, exp_avg)
        state["exp_avg_sq"].index_copy_(0, rows, exp_avg_sq)
        step_size = self.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        add_to_rows(weight, rows, exp_avg / exp_avg_sq.sqrt_().add_(self.eps), -step_size, rounding)
