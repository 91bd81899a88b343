"""A validation pass that every rank ends at the same batch.

`validation_step` may run collectives (a sharded table's lookup, a DDP forward), so a rank whose
`val_data` has no batch for an index must not simply stop: its peers would wait in the next
batch's first collective until the timeout. As for training (`step_batches`), the ranks agree
before each batch whether every one of them has it; when one does not, every rank ends the pass
there and the values are means over the batches every rank had (the common prefix).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from manualpar.loop.data import Data, step_batches
from manualpar.strategy import ManualParallelStrategy

__all__ = ["Validation", "ValidationPass", "validation_pass"]

log = logging.getLogger("manualpar.trainer")


@dataclass
class ValidationPass:
    """This rank's means of each `validation_step` value over the `batches` every rank ran, and
    the ranks whose data ran out ({rank: the batch index it had none for}; empty if none did)."""

    means: dict[str, float]
    batches: int
    ran_out: dict[int, int] = field(default_factory=dict)


@torch.no_grad()
def validation_pass(
    model: Any, val_data: Data, strategy: ManualParallelStrategy, val_steps: int
) -> ValidationPass:
    """Run `model.validation_step` on batches 0 .. val_steps - 1 of `val_data`, stopping every
    rank at the first index some rank has no batch for (one small all-reduce per batch)."""
    sums: dict[str, float] = {}
    for index in range(val_steps):
        batches, ran_out = step_batches(strategy, val_data, index, 1)
        if batches is None:
            return ValidationPass(_means(sums, index), index, ran_out)
        values: Mapping[str, Any] = model.validation_step(batches[0])
        for name, value in values.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    return ValidationPass(_means(sums, val_steps), val_steps)


def _means(sums: Mapping[str, float], count: int) -> dict[str, float]:
    return {name: total / count for name, total in sums.items()} if count else {}


class Validation:
    """The Trainer's validation passes: runs them and reports a cut once (the same data cuts
    every later pass at the same batch)."""

    def __init__(self, strategy: ManualParallelStrategy, val_steps: int) -> None:
        self.strategy, self.val_steps = strategy, val_steps
        self.ran_out: dict[int, int] = {}  # of the last pass cut short: {rank: batch index}
        self._cut: int | None = None  # the batches of the last pass reported as cut short

    def run(
        self, model: Any, val_data: Data, step: int
    ) -> tuple[dict[str, float], dict[str, Any] | None]:
        """(this rank's means, a metrics.jsonl event to record or None) of one pass."""
        done = validation_pass(model, val_data, self.strategy, self.val_steps)
        if not done.ran_out:
            return done.means, None
        self.ran_out = done.ran_out
        if done.batches == self._cut:
            return done.means, None
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
        return done.means, {"step": step, **event, "batches": done.batches}
