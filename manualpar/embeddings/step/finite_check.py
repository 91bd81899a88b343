"""Non-finite gradients never reach the table rows.

The fused update runs inside backward, so once a NaN or inf output gradient reaches it nothing
can skip the step afterwards: one NaN loss used to leave NaN rows for good (`max_grad_norm` does
not stop NaN). So each rank sums its output gradient (a NaN or inf anywhere makes the sum
non-finite; measured 0.03 ms for a (1024, 512) gradient, against 1 ms for an element-wise
isfinite; the columns of frozen tables are left out: nothing uses their gradient) and the flags
travel to every rank before the first row changes. Each rank's flag rides in the gradient
all_to_all, one element of the wire dtype after its gradient for each other rank (every step
that has that exchange: some routed table not frozen; the planner counts it, planning/
exchange_bytes.py). Where that exchange reaches every rank of the job (no replicas of a 2-D
mesh) and no half-row guard needs the job's sums (SGD's: half_overflow.py; the others raise
the ridden flag where a rank cannot rule an overflow out alone), the ridden flags decide
(`RiddenFlags`): every rank receives every other rank's flag, so all decide alike with no
collective of their own (starting one cost about 0.3 ms of a 26-table rank step), and the update
then waits for the gradients before its first row (one pass over every row, not the own rows
while the others' travel). Otherwise (replicas, an SGD half-row guard, no gradient exchange)
the flags are summed over the job in one small all_reduce, started before the gradient
exchange; the half-row guard's answers (half_overflow.py) ride in it: it always carries the
flag and RIDERS float64 numbers (zeros where no guard runs), so every rank issues the same
collective, of the same shape, whatever it guards, and a guarded step costs one small
collective, not two. Only when a flag is up do the
ranks count per table and name the ranks (a finite sum that overflowed is found finite there
and the step goes on). Then, on every rank alike:

- "raise" (the default): NonFiniteError naming the tables, the ranks, the update and the counts;
  no row, optimizer state or update count changed anywhere;
- "skip": the step's sparse update is dropped on every rank and counted (`skipped`); the
  Trainer then skips the dense optimizer step too.

A table weight replaced between the step's forward and its backward (step/weight_guard.py:
`unchanged`) raises this rank's flag too (`replaced`), and its message travels with the counts:
every rank then raises the same BuilderError at this backward, in either mode, before any row
is updated (before, only the ranks that replaced it raised; the others updated and stopped at
their next collective's timeout). The usual step pays only the guard's identity checks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.step.parts import StepParts
from manualpar.errors import BuilderError, NonFiniteError

if TYPE_CHECKING:
    from manualpar.embeddings.step.wire import Arriving
    from manualpar.strategy import PendingCollective

__all__ = ["NON_FINITE_MODES", "RIDERS", "FiniteCheck", "Flags", "RiddenFlags", "check_mode"]

NON_FINITE_MODES = ("raise", "skip")
RIDERS = 5  # numbers another check sums in the flags' all_reduce (the half-row guard's)
log = logging.getLogger("manualpar.embeddings")


def check_mode(mode: object) -> str:
    if mode not in NON_FINITE_MODES:
        raise BuilderError(
            f"{BUILDER}(): non_finite must be one of {NON_FINITE_MODES}, got {mode!r}"
        )
    return str(mode)


class Flags(Protocol):
    """The job's flags in flight: `wait()[0]` is non-zero if any rank's gradient may hold a
    NaN or inf."""

    def wait(self) -> torch.Tensor: ...


@dataclass
class RiddenFlags:
    """The flags carried by the gradient all_to_all (see above): ours, and each other sender's
    at `ends` of what arrives (`gradients`, whose wait gives the same tensor each time: the
    gradient blocks are read from it around the flags, GradientLayout.grad_blocks' `trailer`)."""

    own: torch.Tensor  # this rank's flag, (1,)
    gradients: Arriving
    ends: list[int]  # where each other sender's flag arrives

    def wait(self) -> torch.Tensor:
        received = self.gradients.wait()
        if not self.ends:
            return self.own
        if len(self.ends) == 1:  # two ranks: a slice (an index tensor costs more than the rest)
            theirs = received[self.ends[0] : self.ends[0] + 1]
        else:
            theirs = received[self.ends].sum().reshape(1)
        return theirs + self.own.to(received.dtype)


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
        self._column_table = column_table
        self._grad = torch.zeros(0)
        self._frozen: frozenset[int] = frozenset()
        self._no_riders = torch.zeros(RIDERS, dtype=torch.float64)
        self._replaced: str | None = None  # this step's replaced weight (`replaced`), if any

    def start(self, flag: torch.Tensor, riders: torch.Tensor | None = None) -> PendingCollective:
        """This rank's `flag` (`flag()`'s) summed over the job (in flight on return). `riders`:
        RIDERS float64 numbers summed in the same all_reduce (`riders()` reads them)."""
        flag = flag.to(torch.float64)
        if riders is None:
            if self._no_riders.device != flag.device:  # kept there: no copy a step
                self._no_riders = self._no_riders.to(flag.device)
            riders = self._no_riders
        assert riders.shape == (RIDERS,), riders.shape  # the same collective on every rank
        flags = torch.cat((flag, riders.to(flag.device)))
        return self.parts.strategy.all_reduce_async(
            flags, name=f"{BUILDER}: non-finite gradient flag all_reduce"
        )

    def flag(self, grad: torch.Tensor, frozen: frozenset[int]) -> torch.Tensor:
        """This rank's flag, (1,) float32: 1 if its gradient may hold a NaN or inf (`frozen`
        tables' columns do not count: every rank agrees on them), else 0. It rides in the
        gradient all_to_all (`RiddenFlags`), and `start` sums it over the job where needed."""
        self._grad, self._frozen = grad, frozen
        total = (
            grad.sum()
            if not frozen
            else grad.sum(0)[self._trained_columns(frozen, grad.device)].sum()
        )
        return (~torch.isfinite(total)).to(torch.float32).reshape(1)

    def replaced(self, flag: torch.Tensor, unchanged: Callable[[], None]) -> torch.Tensor:
        """`flag`, raised where `unchanged` (the weight guard's, for this step's trained
        tables) finds a weight replaced since the lookup: `passed` then raises its error on
        every rank."""
        try:
            unchanged()
        except BuilderError as error:
            self._replaced = str(error)
            return torch.ones_like(flag)
        self._replaced = None
        return flag

    @staticmethod
    def riders(pending: Flags) -> list[float]:
        """The riders of `start`, summed over the job (waits if `passed` has not)."""
        return pending.wait()[1:].tolist()

    def _trained_columns(self, frozen: frozenset[int], device: torch.device) -> torch.Tensor:
        """The gradient's columns of the tables not frozen (a mask)."""
        mask = torch.ones_like(self._column_table, dtype=torch.bool)
        for t in frozen:
            mask &= self._column_table != t
        return mask.to(device)

    def _counts(self, grad: torch.Tensor) -> list[int]:
        """This rank's non-finite values per table not frozen (the slow, exact count)."""
        per_column = (~torch.isfinite(grad)).sum(0)
        counts = torch.zeros(len(self.parts.routing.tables), dtype=torch.int64)
        counts.index_add_(0, self._column_table, per_column.cpu())
        for t in self._frozen:
            counts[t] = 0
        return counts.tolist()

    def passed(self, pending: Flags) -> bool:
        """True if no rank's gradient held a non-finite value; else raise or count a skip."""
        grad, self._grad = self._grad, torch.zeros(0)  # not kept past its step
        replaced, self._replaced = self._replaced, None
        if not bool(pending.wait()[0]):
            return True
        parts = self.parts
        reports = parts.strategy.all_gather_object((self._counts(grad), replaced))
        _refuse_replaced([message for _, message in reports if message], len(reports))
        per_rank = [counts for counts, _ in reports]
        totals = [sum(column) for column in zip(*per_rank, strict=True)]
        if not any(totals):  # a finite sum that overflowed: nothing is wrong
            return True
        bad = [rank for rank, counts in enumerate(per_rank) if any(counts)]
        tables = ", ".join(f"{parts.name(t)!r}: {n}" for t, n in enumerate(totals) if n)
        update = parts.optimizer.num_updates + 1
        what = (
            f"{BUILDER}: update {update}: the output gradient holds {sum(totals)} "
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


def _refuse_replaced(messages: list[str], ranks: int) -> None:
    """Every rank's BuilderError for the weights replaced mid-step on the ranks of `messages`
    (each names its table and rank), if any, out of `ranks` ranks."""
    if messages:
        every = " (every rank stops at this backward: none updated a row)" if ranks > 1 else ""
        raise BuilderError("; ".join(messages) + every)
