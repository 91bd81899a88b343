"""The most one Adam update moves an element of a half table's rows (the half-row guard's bound,
half_bounds.py), from a bound on its moments rather than on the gradient.

Adam (update_rules.Adam) moves an element by lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) +
eps), with m = b1 m + (1 - b1) g and v = b2 v + (1 - b2) g^2. If |m| <= C sqrt(v) before an
update, then after it, by Cauchy-Schwarz,

    |m'| <= b1 C sqrt(v) + (1 - b1) |g| <= sqrt(b1^2 C^2 / b2 + (1 - b1)^2 / (1 - b2)) sqrt(v'),

whatever g is. So a block's C, read once from its moments (the largest |m| / sqrt(v)), is grown
by each update through that recursion (rows not touched keep their ratio: C never shrinks
here), and the step is at most the step size times C. Where b1^2 < b2 (the default betas),
C tends to (1 - b1) / sqrt((1 - b2)(1 - b1^2 / b2)), 7.3 for (0.9, 0.999); a row first touched
late (lazy Adam's bias correction counts every update) stays below it too. Where b1^2 >= b2,
C grows with every update without limit (geometrically where b1^2 > b2) while the moments' real
ratio usually stays small: so once C has grown to twice what the last read found (`loose`) and
its step takes half the rows' headroom, the guard reads the moments again (half_bounds.py)
instead of copying the rows on every step from then on; it copies only while the real ratio is
that large. Under the default betas C never gets loose (it stays below its limit or the read
value), so nothing is read again. With b2 = 0, v forgets at once while m does not: no bound
(`AdamSteps.of` gives None).

Float32 rounding of the moments is covered by a 0.1% growth per update; gradients too small for
(1 - b2) g^2 to be a normal float32 (|g| below 2**-63 / sqrt(1 - b2)) lose their share of v,
which lets |m| pass C sqrt(v) by at most 2**-60 (C + 1 / sqrt(1 - b2)): the bound adds that
over eps. A loaded state whose ratio cannot be bounded (v < 0, NaN, m without v) reads as inf:
the guard then copies the rows, as for a rule without a bound.
"""

from __future__ import annotations

import math

import torch

from manualpar.embeddings.optim.update_rules import Adam

__all__ = ["AdamSteps"]

_MARGIN = 1e-3  # float32 rounding of the moments in one update is far below this
_SUBNORMAL = 2.0**-60  # a lost (subnormal) share of v: |m| may pass C sqrt(v) by this much
_CHUNK = 1 << 20  # moments' elements read at a time by a scan (two 4 MiB float32 buffers)


class AdamSteps:
    """Per table: a bound C on |m| / sqrt(v) over this rank's block (see above)."""

    def __init__(self, rule: Adam) -> None:
        beta1, beta2 = rule.betas
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(rule.eps)
        self._shrink = self.beta1**2 / self.beta2  # of C^2 by an update
        self._fresh = (1 - self.beta1) ** 2 / (1 - self.beta2)  # an update's new share
        self._lost = 1 / math.sqrt(1 - self.beta2)  # |m| / sqrt(v) of one subnormal share
        self.ratio: dict[int, float] = {}  # table -> C (absent: not read)
        self.read_ratio: dict[int, float] = {}  # table -> C as last read from the moments
        # C grown from any start below this stays below it (b1^2 < b2: the recursion's limit
        # with the margin; else one update's growth from zero moments)
        self._settles = math.sqrt(self._fresh) * (1 + _MARGIN)
        kept = self._shrink * (1 + _MARGIN) ** 2
        if kept < 1:
            self._settles = max(self._settles, math.sqrt(self._fresh / (1 - kept)) * (1 + _MARGIN))

    @classmethod
    def of(cls, rule: Adam) -> AdamSteps | None:
        """The bound of `rule`'s steps, None where it has none (b2 = 0)."""
        return cls(rule) if rule.betas[1] > 0 else None

    def step(self, t: int, lr: float, update: int) -> float:
        """The most update number `update` (1, 2, ...) moves an element of table `t`."""
        ratio = self._next(t)
        size = lr * math.sqrt(1 - self.beta2**update) / (1 - self.beta1**update)
        return size * (ratio + _SUBNORMAL * (ratio + self._lost) / self.eps)

    def grow(self, t: int) -> None:
        """Before an update of `t`: C as the update leaves the moments."""
        self.ratio[t] = self._next(t)

    def read(self, t: int, state: dict[str, torch.Tensor]) -> bool:
        """Read C from the moments (a scan); False where it is unbounded."""
        exp_avg, exp_avg_sq = state.get("exp_avg"), state.get("exp_avg_sq")
        ratio = 0.0
        if exp_avg is not None and exp_avg_sq is not None:
            ratio = self._largest(exp_avg.reshape(-1), exp_avg_sq.reshape(-1))
        self.ratio[t] = self.read_ratio[t] = ratio
        return math.isfinite(ratio)

    def loose(self, t: int) -> bool:
        """Whether C has grown past twice the last read (and past where the recursion settles):
        the moments read again may well give a much smaller one (b1^2 >= b2)."""
        ratio, read = self.ratio.get(t), self.read_ratio.get(t)
        if ratio is None or read is None or not math.isfinite(ratio):
            return False
        return ratio > 2 * max(read, self._settles)

    def _largest(self, m: torch.Tensor, v: torch.Tensor) -> float:
        """max |m| / sqrt(v) over the flat moments, less the lost shares' allowance (0/0: 0;
        v < 0 or NaN: inf; never below 0). Each read once from memory: a slice at a time
        (`_CHUNK` elements) goes through abs, subtract, sqrt, divide and max in two buffers
        reused across slices, not 8 passes with fresh temporaries (15-46 ms of thread time for
        100k x 64 on one thread, now 5.4-6.1). Unmasked: an element whose |m| is within the
        allowance gives a ratio <= 0 (or -inf), below the 0 a read starts from, except 0 / 0,
        which gives NaN, as do v < 0 or NaN and m NaN: a slice whose max is NaN is read again
        the exact way (`_exact`), so the bound has the same bits."""
        lost = _SUBNORMAL * self._lost
        largest = 0.0
        size = min(m.numel(), _CHUNK)
        over, ratio = m.new_empty(size), m.new_empty(size)
        for start in range(0, m.numel(), _CHUNK):
            mc, vc = m[start : start + _CHUNK], v[start : start + _CHUNK]
            x, y = over[: mc.numel()], ratio[: mc.numel()]
            torch.abs(mc, out=x).sub_(lost)  # as (|m| - lost) before, less the clamp
            torch.div(x, torch.sqrt(vc, out=y), out=y)
            found = float(y.max())
            if math.isnan(found):
                found = self._exact(mc, vc)
            largest = max(largest, found)
            if largest == math.inf:
                break
        return largest

    def _exact(self, m: torch.Tensor, v: torch.Tensor) -> float:
        """`_largest` of a slice holding a NaN ratio, element by element as defined."""
        if not bool(v.min() >= 0):  # a negative or NaN v: an update can shrink it to nothing
            return math.inf
        over = (m.abs() - _SUBNORMAL * self._lost).clamp_(min=0)  # NaN stays NaN
        ratio = over / v.sqrt()  # over > 0 with v = 0: inf
        ratio = torch.where(over == 0, 0.0, ratio)
        largest = float(ratio.max())
        return math.inf if math.isnan(largest) else largest

    def _next(self, t: int) -> float:
        ratio = self.ratio.get(t, math.inf)
        if not math.isfinite(ratio):
            return math.inf
        grown = math.sqrt(self._shrink * ratio * ratio + self._fresh) * (1 + _MARGIN)
        return max(ratio, grown)
