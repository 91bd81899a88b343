"""Half rows that overflow in the update are put back and reported, as non-finite gradients are.

A finite gradient can still carry a float16 row past 65504 (a learning rate too large for the
rows' range): the row becomes inf, and the next forward's NaN is then blamed on the gradient
(finite_check.py) with the rows already lost. So around the update of a collection with half
tables (float16 or bfloat16, not frozen this step):

- before it, the rows the step touches and their optimizer state are copied aside, in every
  table it updates (a gather of the step's slots: the fused update writes rows in place, so
  nothing else could undo it; float32 tables too, so that an undone step changed nothing);
- after it, the half tables' touched rows are gathered again and their smallest and largest
  values taken (NaN propagates, an overflow is +-inf), and one flag is summed over the job;
- if any rank's rows overflowed, every rank puts its rows, state and update count back, then
  raises NonFiniteError naming the tables, the ranks and the row counts, or under "skip" drops
  the step and counts it, exactly as for a non-finite gradient.

It costs two gathers of the touched rows a step: measured 2.1-2.4x the step of 8 float16 tables
(examples/benchmarks/bench_half_guard.py; docs/benchmarks.md), the price of an undo done outside
the update kernels. So it is built only when asked (`shard_embeddings(...,
guard_half_rows=True)`), to find the step and the rows that overflow; collections without half
tables build none either way.
"""

from __future__ import annotations

import logging

import torch

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.kernels.rounding import HALF_DTYPES
from manualpar.embeddings.step.finite_check import FiniteCheck
from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.results import SavedForBackward
from manualpar.embeddings.step.rows_before import RowsBefore, restore_rows, save_rows
from manualpar.errors import NonFiniteError

__all__ = ["HalfRowsGuard", "half_rows_guard"]

log = logging.getLogger("manualpar.embeddings")


def half_rows_guard(parts: StepParts, finite: FiniteCheck) -> HalfRowsGuard | None:
    """A guard if any table of the collection stores half rows (the same answer on every rank:
    it is read from the tables' configs, not from this rank's blocks)."""
    if not any(config.dtype in HALF_DTYPES for config in parts.routing.tables):
        return None
    return HalfRowsGuard(parts, finite)


class HalfRowsGuard:
    """Saves, checks and if need be restores a step's half rows (see above)."""

    def __init__(self, parts: StepParts, finite: FiniteCheck) -> None:
        self.parts, self.finite = parts, finite
        self.half = frozenset(
            t for t, config in enumerate(parts.routing.tables) if config.dtype in HALF_DTYPES
        )

    def applies(self, frozen: frozenset[int]) -> bool:
        """Whether this step updates a half table (agreed: `frozen` is the same everywhere)."""
        return bool(self.half - frozen)

    def save(self, saved: SavedForBackward) -> list[RowsBefore]:
        """Copy aside this rank's rows the update may write, and their optimizer state."""
        return save_rows(self.parts, saved, self.half)

    def passed(self, before: list[RowsBefore]) -> bool:
        """After the update: True if no rank's half rows overflowed; else every rank restores
        its rows and raises, or counts a skip (returns False)."""
        parts = self.parts
        flag = torch.zeros(1, dtype=torch.int64)
        for saved in before:
            if not saved.half:
                continue
            written = parts.weight(saved.table).index_select(0, saved.slots)
            low, high = torch.aminmax(written)  # NaN propagates; an overflow is +-inf
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                flag[0] = 1
                break
        parts.strategy.all_reduce_(flag, "sum", name=f"{BUILDER}: half-row overflow all_reduce")
        if not int(flag.item()):
            return True
        per_rank = parts.strategy.all_gather_object(self._counts(before))
        totals = [sum(column) for column in zip(*per_rank, strict=True)]
        if not any(totals):  # cannot happen (a flag is raised only on a non-finite value)
            return True
        self._restore(before)
        bad = [rank for rank, counts in enumerate(per_rank) if any(counts)]
        tables = ", ".join(f"{parts.name(t)!r}: {n}" for t, n in enumerate(totals) if n)
        update = parts.optimizer.num_updates + 1
        what = (
            f"{BUILDER}: update {update}: {sum(totals)} half-precision rows overflowed to inf "
            f"or NaN in the update (by table: {tables}) on rank {', '.join(map(str, bad))}"
        )
        if self.finite.mode == "raise":
            raise NonFiniteError(
                f"{what}; the update was undone on every rank: no table row or optimizer state "
                "changed. Lower the learning rate, or store these tables in bfloat16 or float32 "
                "(float16 holds values up to 65504); shard_embeddings(..., non_finite='skip') "
                "drops such steps instead (counted; the Trainer then skips the dense step too)"
            )
        self.finite.skipped += 1
        if parts.strategy.is_global_zero:
            log.warning(
                "%s; the sparse update is undone on every rank (%d skipped so far)",
                what,
                self.finite.skipped,
            )
        return False

    def _counts(self, before: list[RowsBefore]) -> list[int]:
        """Distinct rows per table that hold a non-finite value (the slow path: on a fault)."""
        counts = [0] * len(self.parts.routing.tables)
        for saved in before:
            if not saved.half:
                continue
            slots = saved.slots.unique()
            written = self.parts.weight(saved.table).index_select(0, slots)
            counts[saved.table] += int((~torch.isfinite(written)).any(1).sum())
        return counts

    def _restore(self, before: list[RowsBefore]) -> None:
        restore_rows(self.parts, before)
        self.parts.optimizer.num_updates -= 1
