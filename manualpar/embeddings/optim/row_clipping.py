"""Gradient clipping inside the fused update: per row, and over the whole collection.

A table's gradient exists only as the summed gradients of the rows a step touched (every other
row's is zero), so both clips act on those rows. The factor is torch's
(`torch.nn.utils.clip_grad_norm_`): max_norm / (norm + 1e-6), capped at 1, so a gradient under
the limit is multiplied by 1 (nearly unchanged, as with torch) and one over it ends at the limit.
"""

from __future__ import annotations

import math

import torch

from manualpar.errors import BuilderError

__all__ = ["EPS", "check_max_norm", "clip_coefficient", "clip_rows"]

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def check_max_norm(value: object, name: str, where: str) -> None:
    """None (no clipping) or a finite number > 0."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise BuilderError(
            f"{where}: {name} must be a finite number > 0 (or None: no clipping), got {value!r}"
        )


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that brings a gradient of L2 norm `norm` to at most `max_norm`."""
    return (max_norm / (norm + EPS)).clamp_(max=1.0)


def clip_rows(summed: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Each row of `summed` (rows, full width) scaled to an L2 norm of at most `max_norm`."""
    norms = torch.linalg.vector_norm(summed, dim=1)
    return summed * clip_coefficient(norms, max_norm).unsqueeze(1)
