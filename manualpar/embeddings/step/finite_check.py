"""Non-finite gradients never reach the table rows.

The fused update runs inside backward, so once a NaN or inf output gradient reaches it nothing
can skip the step afterwards: one NaN loss used to leave NaN rows for good (`max_grad_norm`
does not stop NaN). So each rank counts the non-finite values of its output gradient per table
(one reduction over the (batch, total dim) gradient) and the counts are summed over the job in
one small all_reduce, started beside the gradient exchange and waited for before the first row
changes. Then, on every rank alike:

- "raise" (the default): NonFiniteError naming the tables, the ranks, the update and the counts;
  no row, optimizer state or update count changed anywhere;
- "skip": the step's sparse update is dropped on every rank and counted (`skipped`); the
  Trainer then skips the dense optimizer step too.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.step.parts import StepParts
from manualpar.errors import BuilderError, NonFiniteError

if TYPE_CHECKING:
    from manualpar.strategy import PendingCollective

__all__ = ["NON_FINITE_MODES", "FiniteCheck", "check_mode"]

NON_FINITE_MODES = ("raise", "skip")
log = logging.getLogger("manualpar.embeddings")


def check_mode(mode: object) -> str:
    if mode not in NON_FINITE_MODES:
        raise BuilderError(
            f"{BUILDER}(): non_finite must be one of {NON_FINITE_MODES}, got {mode!r}"
        )
    return str(mode)


class FiniteCheck:
    """Counts a step's non-finite output gradients per table over the job (see above)."""

    def __init__(self, parts: StepParts, mode: str) -> None:
        self.parts, self.mode = parts, check_mode(mode)
        self.skipped = 0  # sparse updates dropped under "skip"
        routing = parts.routing
        column_table = torch.empty(routing.total_dim, dtype=torch.int64)
        for f, (_, t) in enumerate(routing.features):
            start = routing.feature_offsets[f]
            column_table[start : start + routing.dims[f]] = t
        self._column_table = column_table.to(parts.device)
        self._mine = torch.zeros(0)

    def start(self, grad: torch.Tensor) -> PendingCollective:
        """This rank's counts per table, summed over the job (in flight on return)."""
        per_column = (~torch.isfinite(grad)).sum(0)
        counts = torch.zeros(len(self.parts.routing.tables), dtype=torch.int64, device=grad.device)
        counts.index_add_(0, self._column_table, per_column)
        self._mine = counts.clone()
        return self.parts.strategy.all_reduce_async(
            counts, name=f"{BUILDER}: non-finite gradient count all_reduce"
        )

    def passed(self, pending: PendingCollective) -> bool:
        """True if no rank's gradient held a non-finite value; else raise or count a skip."""
        counts = pending.wait()
        if not bool(counts.any()):
            return True
        parts = self.parts
        ranks = parts.strategy.all_gather_object(int(self._mine.sum()))
        bad = [rank for rank, count in enumerate(ranks) if count]
        tables = ", ".join(
            f"{parts.name(t)!r}: {count}" for t, count in enumerate(counts.tolist()) if count
        )
        update = parts.optimizer.num_updates + 1
        what = (
            f"{BUILDER}: update {update}: the output gradient holds {int(counts.sum())} "
            f"non-finite values (NaN or inf; by table: {tables}) from rank "
            f"{', '.join(map(str, bad))}"
        )
        if self.mode == "raise":
            raise NonFiniteError(
                f"{what}; no table row or optimizer state was changed on any rank. Look for "
                "the NaN or inf in that rank's loss (mp.check_finite), lower the learning rate, "
                "or pass shard_embeddings(..., non_finite='skip') to drop such steps (counted; "
                "the Trainer then skips the dense step too)"
            )
        self.skipped += 1
        if parts.strategy.is_global_zero:
            log.warning(
                "%s; the sparse update is skipped on every rank (%d so far)", what, self.skipped
            )
        return False
