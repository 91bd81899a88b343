"""One optimizer step of the Trainer: its micro-batches, then the update.

Each micro-batch runs `training_step` under the precision's autocast and backpropagates its
loss divided by the number of micro-batches; the returned values are averaged the same way.
Then the step is dropped whole if a sharded collection dropped an update for non-finite
gradients (its `non_finite="skip"`) or the dense gradients are not finite (dense_finite.py;
`Trainer(non_finite=...)`: "raise" stops the run first); else the dense gradients are clipped
and the optimizer steps. The schedulers step either way.

Dropped whole means no update of any micro-batch stays: the fused optimizer updates the tables
inside each backward, so where a step can be dropped (some "skip") the collections hold their
updates undoable until the step is decided (embeddings/step/update_journal.py) and undo them
then. Every rank decides alike: the tables' flags and the dense flag are agreed over the job.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from manualpar.builders import total_grad_norm
from manualpar.builders.grad_norm import clip_grads_with_norm_
from manualpar.embeddings import ShardedEmbeddingBagCollection, ShardedEmbeddingCollection
from manualpar.errors import ConfigError
from manualpar.loop.dense_finite import DenseFiniteCheck
from manualpar.loop.precision import Precision
from manualpar.loop.step_times import DENSE_FORWARD_BACKWARD
from manualpar.phase_times import UPDATE, PhaseTimes, timed
from manualpar.strategy import ManualParallelStrategy

__all__ = ["TrainStep"]

log = logging.getLogger("manualpar.trainer")


class TrainStep:
    """The Trainer's step over `accumulate` micro-batches (see the module docstring)."""

    def __init__(
        self,
        precision: Precision,
        strategy: ManualParallelStrategy,
        accumulate: int,
        clip_grad_norm: float | None,
        non_finite: str | None = None,
    ) -> None:
        self.precision, self.device = precision, strategy.device
        self.accumulate, self.clip_grad_norm = accumulate, clip_grad_norm
        self.non_finite = non_finite  # None: the sharded collections' choice (track())
        self.dense_check = DenseFiniteCheck(strategy, non_finite or "raise")
        self.sharded: list[ShardedEmbeddingBagCollection | ShardedEmbeddingCollection] = []
        self.schedulers: Sequence[Any] = []
        self._undoable = False  # whether this fit's steps can be dropped (some "skip")
        self.times = PhaseTimes(strategy.device)  # the Trainer's step times (step_times.py)

    def run(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], step: int
    ) -> dict[str, float]:
        """Step `step` over `batches`: the averaged values `model.training_step` returned
        (and `grad_norm` when clipping, `skipped_non_finite` when the step was dropped)."""
        optimizer.zero_grad(set_to_none=True)
        skipped = self._skipped_updates()
        held = self.sharded if self._undoable else []
        for module in held:
            module.hold_updates()
        try:
            totals = self._micro_batches(model, batches, step)
            dropped = self._skipped_updates() > skipped  # a collection's "skip" dropped one
            finite, norm = (False, None) if dropped else self._dense_check(optimizer, step)
        except BaseException:
            for module in held:  # the error stands; what was applied stays applied
                module.keep_updates()
            raise
        if not finite:
            for module in held:
                module.undo_updates()
            totals["skipped_non_finite"] = 1.0
            if dropped:
                log.warning("step %d: non-finite gradients; the whole step is skipped", step + 1)
        else:
            for module in held:
                module.keep_updates()
            self._optimizer_step(optimizer, totals, norm)
        for scheduler in self.schedulers:
            scheduler.step()
        return totals

    def track(self, model: nn.Module, schedulers: Sequence[Any]) -> None:
        """The model's sharded collections (their skipped updates), the parameter names and
        the schedulers; settles this fit's non-finite policy."""
        self.sharded = [
            m
            for m in model.modules()
            if isinstance(m, ShardedEmbeddingBagCollection | ShardedEmbeddingCollection)
        ]
        self.schedulers = schedulers
        self.dense_check.track(model)
        skips = [module.non_finite == "skip" for module in self.sharded]
        if self.non_finite is None:  # follow the tables: skip if they all skip
            self.dense_check.mode = "skip" if skips and all(skips) else "raise"
        # a step is dropped after some update ran: a dense NaN found after backward, or a
        # table's NaN in a later micro-batch
        self._undoable = self.dense_check.mode == "skip" or (self.accumulate > 1 and any(skips))

    @timed(DENSE_FORWARD_BACKWARD)  # the tables' phases inside it count as their own
    def _micro_batches(self, model: nn.Module, batches: list[Any], step: int) -> dict[str, float]:
        """Forward and backward of each micro-batch; the averaged values."""
        user: Any = model  # training_step is the user's own method, unknown to nn.Module
        totals: dict[str, float] = {}
        for micro, batch in enumerate(batches):
            with self.precision.autocast(self.device):
                out = user.training_step(batch, step * self.accumulate + micro)
            metrics = dict(out) if isinstance(out, Mapping) else {"loss": out}
            if "loss" not in metrics:
                raise ConfigError(
                    f"{type(model).__name__}.training_step must return a loss tensor or a dict "
                    "with 'loss'"
                )
            self.precision.backward(metrics["loss"] / self.accumulate)
            for name, value in metrics.items():
                value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
                totals[name] = totals.get(name, 0.0) + value / self.accumulate
        return totals

    def _skipped_updates(self) -> int:
        return sum(module.skipped_updates for module in self.sharded)

    @timed(UPDATE)
    def _dense_check(
        self, optimizer: torch.optim.Optimizer, step: int
    ) -> tuple[bool, torch.Tensor | None]:
        """Whether the dense gradients are finite on every rank (NonFiniteError if not, under
        "raise"), and their norm when clipping (computed once: the check reuses it)."""
        self.precision.unscale(optimizer)  # the true gradients (fp16's scaler)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = None if self.clip_grad_norm is None else total_grad_norm(params)
        if self.precision.scaler is not None:  # its overflow skips are routine: its business
            return True, norm
        return self.dense_check.passed(params, step, norm), norm

    @timed(UPDATE)
    def _optimizer_step(
        self, optimizer: torch.optim.Optimizer, totals: dict[str, float], norm: torch.Tensor | None
    ) -> None:
        if self.clip_grad_norm is not None and norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            clip_grads_with_norm_(params, self.clip_grad_norm, norm)
            totals["grad_norm"] = float(norm)
        totals.update(self.precision.step(optimizer))
