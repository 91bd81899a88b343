"""The Trainer's option checks: an option out of its range is a ConfigError naming it and the
value, raised when the Trainer is made, before anything is written. docs/trainer-options.md
describes every option."""

from __future__ import annotations

from collections.abc import Mapping

from manualpar.errors import ConfigError
from manualpar.loop.dense_finite import NON_FINITE_MODES
from manualpar.loop.resume_lr import RESUME_LR

__all__ = ["check_options"]


def check_options(
    counts: Mapping[str, int],
    clip_grad_norm: float | None,
    resume_lr: str,
    non_finite: str | None,
) -> None:
    """`counts` (max_steps, accumulate, ...) must be >= 1, `clip_grad_norm` > 0 or None,
    `resume_lr` and `non_finite` one of their choices."""
    for name, value in counts.items():
        if value < 1:
            raise ConfigError(f"Trainer: {name} must be >= 1, got {value}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ConfigError(f"Trainer: clip_grad_norm must be > 0 or None, got {clip_grad_norm}")
    if resume_lr not in RESUME_LR:
        raise ConfigError(f"Trainer: resume_lr must be one of {RESUME_LR}, got {resume_lr!r}")
    if non_finite not in (None, *NON_FINITE_MODES):
        raise ConfigError(
            f"Trainer: non_finite must be one of {NON_FINITE_MODES} or None, got {non_finite!r}"
        )
