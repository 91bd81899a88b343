"""Half rows that overflow in the update are put back and reported, as non-finite gradients are.

A finite gradient can still carry a float16 row past 65504 (a learning rate too large for the
rows' range): the row becomes inf, and the next forward's NaN is then blamed on the gradient
(finite_check.py) with the rows already lost. So around the update of a collection with half
tables (float16 or bfloat16, not frozen this step):

- at gradient dist, each rank asks whether its rows can overflow in this update at all, from
  bounds kept without reading rows (half_bounds.py): its block's largest |value| and the most
  the rule's step moves an element; the answers travel summed over the job in the non-finite
  flags' all_reduce (finite_check.py: one small collective for both), waited for before the
  first row changes. Where the flags ride in the gradient all_to_all instead (it reaches every
  rank, and the rule's step is bounded without the gradient: not SGD), each rank answers alone,
  raising its flag where it cannot rule an overflow out (`ridden_flag`; its own numbers against
  caps whose product keeps the job's sums below the limit), so a guarded step costs no
  collective of its own and the update runs in one pass; a raised flag makes every rank sum
  the answers in an all_reduce (after the non-finite check's count) and decide as before;
- if every rank proved it cannot, the update runs with nothing copied (the usual case: this
  costs a read of the output gradient and a few Python lines a step);
- otherwise, on every rank: the rows the step touches and their optimizer state are copied aside,
  in every table it updates (rows_before.py; float32 tables too, so that an undone step changed
  nothing); after the update the half tables' touched rows are gathered again and their
  smallest and largest values taken (NaN propagates, an overflow is +-inf), and one flag is
  summed over the job; if any rank's rows overflowed, every rank puts its rows, state and update
  count back, then raises NonFiniteError naming the tables, the ranks and the row counts, or
  under "skip" drops the step and counts it, exactly as for a non-finite gradient.

The copy path cost 2.1-2.4x the step of 8 float16 tables (examples/benchmarks/
bench_half_guard.py; docs/benchmarks.md); the bounds make it rare, so the guard is on by default
where the rule has a bound (SGD, Adagrad, row-wise Adagrad, Adam through its moments; not Adam
with b2 = 0, which has none: `guard_half_rows=True` guards it with the copy on every step).
"""

from __future__ import annotations

import logging

import torch

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.kernels.rounding import HALF_DTYPES
from manualpar.embeddings.step.finite_check import FiniteCheck, Flags
from manualpar.embeddings.step.half_bounds import GRADIENT_LIMIT, MARGIN, RowBounds
from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.results import SavedForBackward
from manualpar.embeddings.step.rows_before import RowsBefore, restore_rows, save_rows
from manualpar.errors import NonFiniteError

__all__ = ["HalfRowsGuard", "half_rows_guard"]

log = logging.getLogger("manualpar.embeddings")
_ANSWERS = 5  # the numbers `answers` gives (at most finite_check.RIDERS: they ride its flags)
# `ridden_flag`'s caps on world size x this rank's largest bag gradient, served ids' weight and
# shared bags: under all three, the job's sums keep a row's summed gradient (needs_copy's
# `gradient`) below GRADIENT_LIMIT for a sender scale up to about 90
_RIDDEN_CAPS = (1e9, 1e10, 1e9)


def half_rows_guard(parts: StepParts, finite: FiniteCheck) -> HalfRowsGuard | None:
    """A guard if any table of the collection stores half rows (the same answer on every rank:
    it is read from the tables' configs, not from this rank's blocks)."""
    if not any(config.dtype in HALF_DTYPES for config in parts.routing.tables):
        return None
    return HalfRowsGuard(parts, finite)


class HalfRowsGuard:
    """Rules an overflow of a step's half rows out, or saves, checks and if need be restores
    them (see above)."""

    def __init__(self, parts: StepParts, finite: FiniteCheck) -> None:
        self.parts, self.finite = parts, finite
        self.half = frozenset(
            t for t, config in enumerate(parts.routing.tables) if config.dtype in HALF_DTYPES
        )
        self.bounds = RowBounds(parts, self.half)
        self._tables: list[int] = []  # the half tables this step updates
        self._lr = 0.0
        self._ridden: list[float] | None = None  # this step's answers where its flag rode

    @property
    def rides(self) -> bool:
        """Whether a rank can answer alone (`ridden_flag`): the rule's step is bounded
        without the gradient's sum over the job (not SGD's)."""
        return self.bounds.bounded and not self.bounds.by_gradient

    @property
    def bounded(self) -> bool:
        """Whether the rule's steps can be bounded (else every guarded step copies)."""
        return self.bounds.bounded

    def applies(self, frozen: frozenset[int]) -> bool:
        """Whether this step updates a half table (agreed: `frozen` is the same everywhere)."""
        return bool(self.half - frozen)

    def answers(self, grad: torch.Tensor, saved: SavedForBackward) -> torch.Tensor:
        """At gradient dist (`grad` as it will travel): whether this rank's rows can overflow
        in this update, as numbers to be summed over the job (they ride in the non-finite
        flags' all_reduce, see above). Every rank asks when `applies`."""
        return torch.tensor(self._numbers(grad, saved), dtype=torch.float64)

    def _numbers(self, grad: torch.Tensor, saved: SavedForBackward) -> list[float]:
        self._tables = sorted(self.half - saved.frozen)
        self._lr = self.parts.optimizer.lr
        unsafe = not self.bounds.safe(self._tables, self._lr)
        largest = 0.0
        if grad.numel():  # amax and amin: 0.05 ms for a (1024, 512) gradient, aminmax 0.08
            largest = max(-float(grad.amin()), float(grad.amax()))  # NaN propagates
        return [
            float(unsafe),
            self.bounds.share(self._tables),
            largest,  # NaN or inf: the non-finite check drops the step first
            _served_weight(saved),
            _shared_bags(grad, saved),
        ]

    def ridden_flag(
        self, flag: torch.Tensor, grad: torch.Tensor, saved: SavedForBackward
    ) -> torch.Tensor:
        """At gradient dist, where the flags ride in the all_to_all (`rides`): the non-finite
        `flag`, raised also where this rank cannot rule an overflow out alone: its bounds, or
        its numbers past `_RIDDEN_CAPS` (each sum over the job is at most the world size times
        the largest rank's number)."""
        numbers = self._ridden = self._numbers(grad, saved)
        unsafe, _, largest, served, shared = numbers
        world = self.parts.routing.world_size
        scale = max((abs(s) for s in saved.scales), default=1.0)
        caps = _RIDDEN_CAPS
        gradient = caps[0] * caps[1] * (1 + caps[2]) * scale * (1 + 10 * MARGIN)
        alone = (
            not unsafe
            and world * largest <= caps[0]
            and world * served <= caps[1]
            and world * shared <= caps[2]
            and gradient <= GRADIENT_LIMIT
        )
        return flag if alone else torch.ones_like(flag)

    def needs_copy(self, saved: SavedForBackward, flags: Flags) -> bool:
        """Before the update, given the job's `flags` (with `answers` summed over the job
        riding in them, or ridden flags): True unless every rank proved its rows cannot
        overflow (the same answer on every rank: it is computed from the job's sums alone)."""
        numbers, self._ridden = self._ridden, None
        if numbers is None:
            summed = FiniteCheck.riders(flags)
        elif not bool(flags.wait()[0]):  # every rank ruled an overflow out alone
            self.bounds.grow(self._tables, self._lr, 0.0)
            return False
        else:  # a rank could not: decide from the job's sums, as with the all_reduce
            summed = self.parts.strategy.all_reduce_(
                torch.tensor(numbers, dtype=torch.float64),
                "sum",
                name=f"{BUILDER}: half-row overflow answers all_reduce",
            ).tolist()
        unsafe, shares, largest, served, shared = summed[:_ANSWERS]
        # a row's summed gradient: at most every served id's weight times the largest bag
        # gradient (one sample's, or a batch of samples' where bags are shared), rounded on
        # the wire
        scale = max((abs(s) for s in saved.scales), default=1.0)
        gradient = largest * served * (1 + shared) * scale * (1 + 10 * MARGIN)
        extra = self._lr * gradient if self.bounds.by_gradient else 0.0
        self.bounds.grow(self._tables, self._lr, extra)  # before: an update cut short is in
        if unsafe or not gradient <= GRADIENT_LIMIT:
            return True
        if self.bounds.by_gradient:  # SGD: every rank's share plus the step, below 1
            return not shares + extra / min(self.bounds.limit.values()) <= 1
        return False

    def kept(self) -> None:
        """After an update that stays: the bounds hold for the rows as it left them."""
        self.bounds.settled(self._tables)

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


def _shared_bags(grad: torch.Tensor, saved: SavedForBackward) -> float:
    """How many more samples' gradients than one a bag's gradient may sum: 0 with a bag
    per sample, else the batch less one (a variable batch per feature, bag_expansion.py)."""
    bags = saved.feature_bags
    if bags is None or all(inverse is None for inverse in bags.inverse):
        return 0.0
    return float(max(grad.shape[0] - 1, 0))


def _served_weight(saved: SavedForBackward) -> float:
    """The ids' weights (1 each if unweighted) in the bags this rank's blocks serve this step,
    and in its replicated tables' bags: what one row's gradient can sum at most."""
    bags = [saved.batch.bags] if saved.batch is not None else list(saved.bags)
    lists = [(b.ids, b.weights) for b in bags] + [(i, w) for i, _, w in saved.feature_ids]
    return sum(
        float(ids.numel()) if weights is None else float(weights.abs().sum())
        for ids, weights in lists
    )
