"""AdamSteps.read's scan of the moments (step/adam_bounds.py) in cache-sized slices: the same
bits as the whole-tensor definition, special values included (zeros, values within the lost
shares' allowance, v = 0, -0.0, negative or NaN v, NaN or inf m), across slice boundaries."""

from __future__ import annotations

import math

import pytest
import torch

import manualpar.embeddings.step.adam_bounds as adam_bounds
from manualpar.embeddings import Adam
from manualpar.embeddings.step.adam_bounds import _SUBNORMAL, AdamSteps


def _defined(steps: AdamSteps, m: torch.Tensor, v: torch.Tensor) -> float:
    """The bound as defined (the scan before it was sliced): max(0, max |m| / sqrt(v) less the
    allowance), 0/0 as 0, v < 0 or NaN and a NaN ratio as inf."""
    if not m.numel():
        return 0.0
    if not bool(v.min() >= 0):
        return math.inf
    over = (m.abs() - _SUBNORMAL * steps._lost).clamp_(min=0)
    ratio = torch.where(over == 0, 0.0, over / v.sqrt())
    largest = float(ratio.max())
    return math.inf if math.isnan(largest) else max(0.0, largest)


SPECIAL = {
    "plain": None,
    "allowance": "within",  # |m| at or below the allowance, with v = 0 there too
    "zero v": "zero_v",  # |m| above it with v = 0: inf
    "minus zero v": "minus_zero",  # v = -0.0: -inf ratios, ignored
    "negative v": "negative",
    "NaN v": "nan_v",
    "NaN m": "nan_m",
    "inf m and v": "inf",
    "all within": "all_within",
    "tiny ratios": "tiny",
}


def _moments(case: str | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(37, 11, generator=g) * 1e-3
    v = torch.rand(37, 11, generator=g) * 1e-6
    at = torch.randint(0, m.numel(), (5,), generator=g)
    lost = _SUBNORMAL * AdamSteps(Adam(lr=1.0))._lost
    flat_m, flat_v = m.view(-1), v.view(-1)
    if case == "within":
        flat_m[at[:2]], flat_m[at[2:]] = lost, 0.0
        flat_v[at] = 0.0
    elif case == "zero_v":
        flat_v[at[0]] = 0.0
    elif case == "minus_zero":
        flat_v[at] = -0.0
    elif case == "negative":
        flat_m[at[0]], flat_v[at[0]] = 0.0, -1e-30
    elif case == "nan_v":
        flat_v[at[0]] = math.nan
    elif case == "nan_m":
        flat_m[at[0]] = math.nan
    elif case == "inf":
        flat_m[at[0]], flat_v[at[0]] = math.inf, math.inf
    elif case == "all_within":
        m.fill_(lost / 2)
        flat_v[at] = 0.0
    elif case == "tiny":
        m.mul_(1e-30)
        v.fill_(1e30)
    return m, v


@pytest.mark.parametrize("chunk", [7, 64, adam_bounds._CHUNK])
@pytest.mark.parametrize("case", list(SPECIAL))
def test_the_sliced_scan_reads_the_defined_bound_bit_for_bit(
    case: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adam_bounds, "_CHUNK", chunk)
    steps = AdamSteps(Adam(lr=1.0, betas=(0.9, 0.999)))
    for seed in range(3):
        m, v = _moments(SPECIAL[case], seed)
        expected = _defined(steps, m, v)
        finite = steps.read(0, {"exp_avg": m, "exp_avg_sq": v})
        assert steps.ratio[0] == expected and finite == math.isfinite(expected), (seed, case)
        assert math.copysign(1.0, steps.ratio[0]) == 1.0  # never -0.0
    empty = torch.zeros(0, 11)
    assert steps.read(1, {"exp_avg": empty, "exp_avg_sq": empty}) and steps.ratio[1] == 0.0
