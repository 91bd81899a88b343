"""A validation pass that every rank ends at the same batch.

`validation_step` may run collectives (a sharded table's lookup, a DDP forward), so a rank whose
`val_data` has no batch for an index must not simply stop: its peers would wait in the next
batch's first collective until the timeout. As for training (`step_batches`), the ranks agree
before each batch whether every one of them has it; when one does not, every rank ends the pass
there and the values are means over the batches every rank had (the common prefix).

A value that is a metric object (reset() and compute(strategy): see loop/metric_objects.py) is
not averaged: it is reset before the pass and computed, exactly over every rank's samples, after.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from manualpar.errors import MetricError
from manualpar.loop.data import Data, step_batches
from manualpar.loop.metric_objects import compute_metrics, held_metrics, is_metric, reset_all
from manualpar.loop.metrics_file import MetricsFile, mean_over_ranks
from manualpar.loop.precision import Precision
from manualpar.strategy import ManualParallelStrategy

__all__ = ["Validation", "ValidationPass", "validation_pass"]

log = logging.getLogger("manualpar.trainer")


@dataclass
class ValidationPass:
    """This rank's means of each `validation_step` number over the `batches` every rank ran, the
    metric objects it returned (by name), and the ranks whose data ran out ({rank: the batch
    index it had none for}; empty if none did)."""

    means: dict[str, float]
    batches: int
    ran_out: dict[int, int] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def validation_pass(
    model: Any,
    val_data: Data,
    strategy: ManualParallelStrategy,
    val_steps: int,
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> ValidationPass:
    """Run `model.validation_step` on batches 0 .. val_steps - 1 of `val_data` (under
    `autocast()`), stopping every rank at the first index some rank has no batch for (one small
    all-reduce per batch)."""
    sums: dict[str, float] = {}
    metrics: dict[str, Any] = {}
    for index in range(val_steps):
        batches, ran_out = step_batches(strategy, val_data, index, 1, name="val_data")
        if batches is None:
            return ValidationPass(_means(sums, index), index, ran_out, metrics)
        with autocast():
            values: Mapping[str, Any] = model.validation_step(batches[0])
        for name, value in values.items():
            if is_metric(value) or name in metrics:
                _check_same_metric(metrics.setdefault(name, value), value, name)
            else:
                sums[name] = sums.get(name, 0.0) + float(value)
    return ValidationPass(_means(sums, val_steps), val_steps, metrics=metrics)


def _check_same_metric(first: Any, value: Any, name: str) -> None:
    if value is not first:
        raise MetricError(
            f"validation_step returned {name!r} as {type(value).__name__} after "
            f"{type(first).__name__} (another object) in the same pass; return the same metric "
            "object on every batch (hold it on the model: self.metric = Metric())"
        )


def _means(sums: Mapping[str, float], count: int) -> dict[str, float]:
    return {name: total / count for name, total in sums.items()} if count else {}


class Validation:
    """The Trainer's validation passes: runs them, reduces and records their values, and reports
    a cut once (the same data cuts every later pass at the same batch)."""

    def __init__(
        self,
        strategy: ManualParallelStrategy,
        val_steps: int,
        metrics_file: MetricsFile,
        precision: Precision,
    ) -> None:
        self.strategy, self.val_steps = strategy, val_steps
        self.metrics_file, self.precision = metrics_file, precision
        self.ran_out: dict[int, int] = {}  # of the last pass cut short: {rank: batch index}
        self._cut: int | None = None  # the batches of the last pass reported as cut short
        self._metrics: list[Any] = []  # metric objects validation_step returned before

    def validate(self, model: nn.Module, val_data: Data, step: int) -> dict[str, float]:
        """One pass in eval mode (left in train mode), its numbers averaged over ranks and its
        metric objects computed, as `val/<name>`, recorded at `step` in the metrics file."""
        autocast = functools.partial(self.precision.autocast, self.strategy.device)
        model.eval()
        try:
            done, computed, event = self.run(model, val_data, step, autocast)
        finally:
            model.train()
        if event is not None:
            self.metrics_file.append(event)
        if not done.batches:  # some rank had no batch at all: nothing to average
            return {}
        reduced = mean_over_ranks(self.strategy, {f"val/{k}": v for k, v in done.means.items()})
        reduced.update({f"val/{k}": v for k, v in computed.items()})
        self.metrics_file.append({"step": step, **reduced})
        return reduced

    def run(
        self,
        model: Any,
        val_data: Data,
        step: int,
        autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> tuple[ValidationPass, dict[str, float], dict[str, Any] | None]:
        """(the pass, its metric objects' computed values, a metrics.jsonl event to record or
        None). Metric objects held by the model or returned before are reset first."""
        reset = reset_all([*held_metrics(model), *self._metrics])
        done = validation_pass(model, val_data, self.strategy, self.val_steps, autocast)
        for name, metric in done.metrics.items():
            if id(metric) not in reset:
                raise MetricError(
                    f"validation_step returned the metric object {name!r} "
                    f"({type(metric).__name__}), which the Trainer could not find on the model "
                    "to reset before the pass; hold it as an attribute of the model or of a "
                    "submodule (self.metric = Metric())"
                )
        self._metrics = list(done.metrics.values())
        with torch.no_grad():
            computed = compute_metrics(done.metrics, self.strategy) if done.batches else {}
        clash = sorted(set(computed) & set(done.means))
        if clash:
            raise MetricError(
                f"validation_step returned plain values and metric objects computing the same "
                f"names {clash}; rename one of them"
            )
        return done, computed, self._cut_event(done, step)

    def _cut_event(self, done: ValidationPass, step: int) -> dict[str, Any] | None:
        if not done.ran_out:
            return None
        self.ran_out = done.ran_out
        if done.batches == self._cut:
            return None
        self._cut = done.batches
        if self.strategy.is_global_zero:  # once for the job: the message names every rank
            where = ", ".join(f"rank {r} (batch {i})" for r, i in done.ran_out.items())
            log.warning(
                "validation data ran out on %s at step %d; every rank ends each validation pass "
                "after %d of val_steps=%d batches, and the val/ metrics are means over those",
                where,
                step,
                done.batches,
                self.val_steps,
            )
        event = {"event": "val_data_ran_out", "ranks": sorted(done.ran_out)}
        return {"step": step, **event, "batches": done.batches}
