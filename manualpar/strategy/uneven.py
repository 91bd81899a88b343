"""All-gather of tensors whose first dim differs by rank (uneven batches, eval samples).

`Collectives.all_gather` needs the same shape on every rank; here each rank's length travels
first (one tiny all_gather), every rank pads to the longest, and the padding is cut off again.
The trailing dims and the dtype must still agree (the strategy's shape check names the rank
that differs). A rank with no rows takes part with a (0, ...) tensor.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from manualpar.errors import ConfigError

__all__ = ["all_gather_uneven"]

Group = Any  # collectives.py's Group, kept opaque (this module needs nothing of the class)


class Gathers(Protocol):
    """What the gather needs of the strategy (collectives.py's Collectives)."""

    def all_gather(self, tensor: torch.Tensor, *, group: Group = None) -> torch.Tensor: ...


def all_gather_uneven(
    strategy: Gathers,
    tensor: torch.Tensor,
    *,
    group: Group = None,
    lengths: list[int] | None = None,
) -> list[torch.Tensor]:
    """Every rank's `tensor` (lengths along dim 0 may differ), in rank order. `lengths`:
    every rank's length when the caller already exchanged them (no size collective then)."""
    if tensor.dim() == 0:
        raise ConfigError("all_gather_uneven: takes a tensor with at least one dim, got a scalar")
    if lengths is None:
        length = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        lengths = strategy.all_gather(length, group=group)[:, 0].tolist()
    longest = max(lengths)
    if longest == 0:  # every rank knows: nothing to send
        return [tensor.detach()[:0].clone() for _ in lengths]
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor.detach()
    gathered = strategy.all_gather(padded, group=group)
    return [gathered[r, :n] for r, n in enumerate(lengths)]
