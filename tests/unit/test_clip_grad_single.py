"""mp.clip_grad_norm_ on one process: torch's clip_grad_norm_ on plain tensors, and its errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import manualpar as mp


def _params_with_grads(seed: int) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(3, 4, generator=generator)) for _ in range(3)]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    params.append(nn.Parameter(torch.zeros(2)))  # no grad: skipped, as torch does
    return params


@pytest.mark.parametrize(("max_norm", "norm_type"), [(1.0, 2.0), (0.1, math.inf), (1e3, 1.0)])
def test_plain_tensors_match_torch(max_norm: float, norm_type: float) -> None:
    ours, theirs = _params_with_grads(0), _params_with_grads(0)
    total = mp.clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


def test_no_gradients_gives_zero_and_changes_nothing() -> None:
    assert mp.clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0).item() == 0.0


def test_bad_max_norm_and_nonfinite_gradients_are_refused() -> None:
    params = _params_with_grads(1)
    with pytest.raises(mp.BuilderError, match="clip_grad_norm_: max_norm must be > 0, got 0"):
        mp.clip_grad_norm_(params, 0)
    params[0].grad[0, 0] = float("nan")
    with pytest.raises(mp.NonFiniteError, match="the total gradient norm is nan"):
        mp.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
