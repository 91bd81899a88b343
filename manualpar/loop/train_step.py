"""One optimizer step of the Trainer: its micro-batches, then the update.

Each micro-batch runs `training_step` under the precision's autocast and backpropagates its
loss divided by the number of micro-batches; the returned values are averaged the same way.
Then, unless a sharded collection dropped its update for non-finite gradients (its
`non_finite="skip"`: the dense gradients hold the same values, so the dense step is skipped
too), the dense gradients are clipped and the optimizer steps; the schedulers step either way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from manualpar.builders import clip_grad_norm_
from manualpar.embeddings import ShardedEmbeddingBagCollection
from manualpar.loop.precision import Precision

__all__ = ["TrainStep"]

log = logging.getLogger("manualpar.trainer")


class TrainStep:
    """The Trainer's step over `accumulate` micro-batches (see the module docstring)."""

    def __init__(
        self,
        precision: Precision,
        device: torch.device,
        accumulate: int,
        clip_grad_norm: float | None,
    ) -> None:
        self.precision, self.device = precision, device
        self.accumulate, self.clip_grad_norm = accumulate, clip_grad_norm
        self.sharded: list[ShardedEmbeddingBagCollection] = []
        self.schedulers: Sequence[Any] = []

    def run(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], step: int
    ) -> dict[str, float]:
        """Step `step` over `batches`: the averaged values `model.training_step` returned
        (and `grad_norm` when clipping, `skipped_non_finite` when the update was dropped)."""
        user: Any = model  # training_step is the user's own method, unknown to nn.Module
        optimizer.zero_grad(set_to_none=True)
        skipped = self._skipped_updates()
        totals: dict[str, float] = {}
        for micro, batch in enumerate(batches):
            with self.precision.autocast(self.device):
                out = user.training_step(batch, step * self.accumulate + micro)
            metrics = dict(out) if isinstance(out, Mapping) else {"loss": out}
            if "loss" not in metrics:
                raise ValueError(
                    f"{type(model).__name__}.training_step must return a loss tensor or a dict "
                    "with 'loss'"
                )
            self.precision.backward(metrics["loss"] / self.accumulate)
            for name, value in metrics.items():
                value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
                totals[name] = totals.get(name, 0.0) + value / self.accumulate
        if self._skipped_updates() > skipped:  # non_finite="skip" dropped a sparse update
            totals["skipped_non_finite"] = 1.0  # the dense gradients hold it too: no step
            log.warning("step %d: non-finite gradients; the dense step is skipped too", step)
        else:
            self._optimizer_step(optimizer, totals)
        for scheduler in self.schedulers:
            scheduler.step()
        return totals

    def track(self, model: nn.Module, schedulers: Sequence[Any]) -> None:
        """The model's sharded collections (their skipped updates) and the schedulers."""
        self.sharded = [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
        self.schedulers = schedulers

    def _skipped_updates(self) -> int:
        return sum(module.skipped_updates for module in self.sharded)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, totals: dict[str, float]) -> None:
        if self.clip_grad_norm is not None:
            self.precision.unscale(optimizer)  # clip the true gradients
            params = [p for group in optimizer.param_groups for p in group["params"]]
            totals["grad_norm"] = float(clip_grad_norm_(params, self.clip_grad_norm))
        totals.update(self.precision.step(optimizer))
