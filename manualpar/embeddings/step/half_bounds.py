"""How large a rank's half rows can be after an update, known without reading them.

The half-row guard (half_overflow.py) must refuse an update that overflows a float16 or
bfloat16 row on any rank, and undo it everywhere. Copying the touched rows aside to be able to
undo cost 2.1-2.4x the step; but under most rules an update moves an element by a bounded
amount whatever the gradient:

- row-wise Adagrad: lr * g_j / (sqrt(s + mean(g^2)) + eps) with s >= 0, at most
  lr * sqrt(dim) (|g_j| <= sqrt(dim * mean(g^2)));
- Adagrad: lr * g_j / (sqrt(s_j + g_j^2) + eps), at most lr;
- SGD: lr times the row's summed gradient, at most lr * (largest bag gradient) * (ids'
  weight) * (sender scale) * (bags a sample's gradient was summed over), bounded from one
  float64 sum over the job;
- Adam: lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps), at most that step size times a
  bound C on |m| / sqrt(v) over the block (adam_bounds.py: read from the moments at a scan,
  then grown by each update, towards (1 - b1) / sqrt((1 - b2)(1 - b1^2 / b2)), 7.3 for the
  default betas; where b1^2 >= b2 it grows without limit and is read again from the moments
  once its step takes half the headroom; with b2 = 0 there is none, and the guard copies as
  before).

So each rank keeps,
per half table, an upper bound on its block's largest |value|: read once (a scan), then grown by
each update's bound. While bound + step bound stays below the dtype's largest finite value
(with a 0.1% margin for float32 rounding), no row can overflow and no copy is needed. A scan is
repeated when torch's version counter says the rows or optimizer state were written other than
by the update (a checkpoint load, an undo, a write by hand), and when the bound has grown past
half the headroom it had at the last scan. Subnormal gradients (squares below 2**-120) lose
precision in the denominator; their steps are at most 2**-60 / eps times the bound above, which
the bound includes. Rows that reach the table by a disk tier's reads are not counted: such
tables keep the copy.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from manualpar.embeddings.modules.bag_collection import table_of
from manualpar.embeddings.optim.update_rules import SGD, Adagrad, Adam, RowWiseAdagrad, UpdateRule
from manualpar.embeddings.step.adam_bounds import AdamSteps
from manualpar.embeddings.step.parts import StepParts

__all__ = ["GRADIENT_LIMIT", "MARGIN", "RowBounds", "step_bound"]

MARGIN = 1e-3  # float32 rounding of w + step and of the step itself is far below this
# A row's summed gradient below this cannot overflow float32 (3.4e38) in any order of sums
GRADIENT_LIMIT = 1e30
_SUBNORMAL = 2.0**-60  # |g| below this: g^2 is subnormal and the denominator imprecise


def step_bound(rule: UpdateRule, lr: float, dim: int) -> float | None:
    """The most one update of `rule` moves an element of a row of width `dim`, whatever the
    gradient (None: it depends on the gradient, SGD, or on the state's history, Adam: see
    AdamSteps)."""
    if isinstance(rule, RowWiseAdagrad):
        return lr * math.sqrt(dim) * max(1 + 10 * MARGIN, _SUBNORMAL / rule.eps)
    if isinstance(rule, Adagrad):
        return lr * max(1 + 10 * MARGIN, _SUBNORMAL / rule.eps)
    return None


class RowBounds:
    """Per half table: an upper bound on |value| over this rank's block (see above)."""

    def __init__(self, parts: StepParts, half: frozenset[int]) -> None:
        self.parts, self.half = parts, half
        rule = parts.optimizer.rule
        self.by_gradient = isinstance(rule, SGD)  # its step bound comes from the gradient
        # Adam's comes from its moments (None: b2 = 0, no bound)
        self.adam = AdamSteps.of(rule) if isinstance(rule, Adam) else None
        self.bounded = (
            self.by_gradient or self.adam is not None or step_bound(rule, 1.0, 1) is not None
        )
        self.limit = {t: _limit(parts.routing.tables[t].dtype) for t in half}
        # the step bound per unit of lr (SGD: 0, its part comes from the gradient); the full
        # width: row-wise statistics are over the whole row under column sharding too
        self._per_lr = {
            t: 0.0 if self.by_gradient else step_bound(rule, 1.0, config.embedding_dim) or 0.0
            for t, config in enumerate(parts.routing.tables)
            if t in half
        }
        self._on_disk = {t: _reads_rows(parts, t) for t in half}
        self.bound: dict[int, float] = {}  # this rank's |value| <= bound (absent: not scanned)
        self.scanned: dict[int, float] = {}  # the bound at its last scan
        self.versions: dict[int, tuple[int, ...]] = {}  # the tensors' versions it holds for
        # each table's weight and state tensors, whose versions say who wrote them (looked up
        # once: per step the guard costs Python lines, measured 25 us a table before)
        self._watched: dict[int, tuple[nn.Module, tuple[torch.Tensor, ...]]] = {}
        self._empty: set[int] = set()  # tables of which this rank holds no rows

    def step(self, t: int, lr: float) -> float:
        """Table `t`'s step bound for a gradient-free rule (SGD: 0, its part comes later) in
        the coming update (Adam's: from its moments' bound, the update count and lr)."""
        if self.adam is not None:
            return self.adam.step(t, lr, self.parts.optimizer.num_updates + 1)
        return self._per_lr[t] * lr

    def safe(self, tables: list[int], lr: float) -> bool:
        """Whether no update of `tables` this step can overflow this rank's rows (scans where
        the bound is stale or too loose)."""
        if not self.bounded:
            return False
        for t in tables:
            if self._on_disk[t]:
                return False
            if t in self._empty:
                continue
            step = self.step(t, lr)
            stale = self.versions.get(t) != self._versions(t)  # written other than by updates
            reread = stale or self._moments_loose(t, step)
            if reread or self._loose(t, step):
                self._scan(t, reread)
                step = self.step(t, lr)  # (Adam's: from the moments just read)
            if not self.bound[t] + step <= self.limit[t]:  # NaN: not safe
                return False
        return True

    def share(self, tables: list[int]) -> float:
        """This rank's largest bound as a fraction of its table's limit (SGD's check sums
        these over the job)."""
        return max((self.bound.get(t, 0.0) / self.limit[t] for t in tables), default=0.0)

    def grow(self, tables: list[int], lr: float, extra: float) -> None:
        """Before an update of `tables`: each bound grows by its step bound (+ `extra`, SGD's),
        so that it holds for the rows however far the update gets."""
        for t in tables:
            if t in self.bound:
                self.bound[t] += self.step(t, lr) + extra
                if self.adam is not None:  # and the moments' bound by this update
                    self.adam.grow(t)

    def settled(self, tables: list[int]) -> None:
        """After an update that stays: the bounds hold for the tensors as it left them."""
        for t in tables:
            if t in self.bound and t not in self._empty:
                self.versions[t] = self._versions(t)

    def _loose(self, t: int, step: float) -> bool:
        """Never scanned, or grown since the last scan past half the headroom it left (and
        past 64 steps, so that rows near the limit are not read every step)."""
        bound, scanned = self.bound.get(t), self.scanned.get(t)
        if bound is None or scanned is None:
            return True
        return bound - scanned >= max((self.limit[t] - scanned) / 2, 64 * step)

    def _moments_loose(self, t: int, step: float) -> bool:
        """Adam's moment bound grown far past its last read (AdamSteps.loose: b1^2 >= b2) with
        its step taking half the headroom left: read the moments again before copying."""
        bound = self.bound.get(t)
        if bound is None or self.adam is None or not self.adam.loose(t):
            return False
        return not bound + 2 * step <= self.limit[t]

    def _scan(self, t: int, stale: bool = True) -> None:
        """Read the block's largest |value| (inf if any is NaN or inf, or if the state would
        let a step grow past its bound: a negative or NaN accumulator)."""
        weight = self.parts.weight(t)
        low = high = 0.0
        if not weight.numel():
            self._empty.add(t)
        else:  # aminmax: 6 ms for 1M x 64 float16 rows, abs().amax() 62 ms
            low, high = (float(value) for value in torch.aminmax(weight))  # NaN propagates
        largest = max(-low, high)
        ok = self._state_ok(t, stale)  # (first: Adam's ratio is read whatever the rows hold)
        if math.isnan(low) or math.isnan(high) or not ok:
            largest = math.inf
        self.bound[t] = self.scanned[t] = largest
        self.versions[t] = self._versions(t)

    def _state_ok(self, t: int, stale: bool) -> bool:
        """Adagrad's bounds need accumulators >= 0 (a loaded state could hold anything);
        Adam's, moments whose ratio is bounded: read again only where `stale` (written other
        than by an update, or its bound loose: `_moments_loose`; the ratio carried through the
        updates holds otherwise; reading it costs 50x the weights' scan)."""
        state = self.parts.optimizer.table_state.get(self.parts.name(t), {})
        if self.adam is not None:
            if stale or t not in self.adam.ratio:
                return self.adam.read(t, state)
            return math.isfinite(self.adam.ratio[t])
        total = state.get("sum")
        return total is None or total.numel() == 0 or bool(total.min() >= 0)

    def _versions(self, t: int) -> tuple[int, ...]:
        """The versions of the table's weight and state (a replaced tensor: (-1,), a scan)."""
        watched = self._watched.get(t)
        if watched is None:
            table = table_of(self.parts.tables, self.parts.name(t))
            state = self.parts.optimizer.table_state.get(self.parts.name(t), {})
            watched = self._watched[t] = (table, (table.weight, *state.values()))
        module, tensors = watched
        if module.weight is not tensors[0]:  # a new Parameter (load_state_dict(assign=True))
            del self._watched[t]
            return (-1,)
        return tuple(tensor._version for tensor in tensors)


def _reads_rows(parts: StepParts, t: int) -> bool:
    """Whether the table's block is a disk tier's cache (rows read in from files)."""
    store = parts.stores.stores.get(t)
    return bool(store is not None and store.reads_rows)


def _limit(dtype: torch.dtype) -> float:
    """The largest |value| a row may reach before the update: the dtype's largest finite
    value less the margin (float16 rounds to nearest: 65504 is kept, 65520 is inf)."""
    return float(torch.finfo(dtype).max) * (1 - MARGIN)
