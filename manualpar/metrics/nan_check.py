"""The one refusal of NaN every metric shares.

A diverged model scores NaN; a NaN has no order and no loss, so a metric that took it would
report a number that means nothing (all-NaN scores once ranked by item id, and with ids in
popularity order that reads as a fair hit rate). Each metric refuses NaN where it first sees
it, with the same error and words.
"""

from __future__ import annotations

import torch

from manualpar.errors import NonFiniteError

__all__ = ["refuse_nan"]


def refuse_nan(values: torch.Tensor, what: str, caller: str, first: str = "") -> None:
    """NonFiniteError naming `caller`, the NaN count among `values` (called `what`) and, if
    given, where the `first` one is; nothing when there is none."""
    nans = torch.isnan(values)
    if not bool(nans.any()):
        return
    where = f", the first in {first}" if first else ""
    raise NonFiniteError(
        f"{caller}: {int(nans.sum())} of {values.numel()} {what} are NaN{where} (a diverged "
        "model?); check the model's outputs before scoring them"
    )
