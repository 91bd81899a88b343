"""A differentiable all_gather, for losses over the global batch (in-batch negatives).

Each rank's slice of the gathered tensor is used by the loss on every rank, so the gradient of
that slice is the sum of the gradients all ranks computed for it: backward all-reduces the
gradient of the whole gathered tensor and keeps this rank's slice (the meaning of
`torch.distributed.nn.functional.all_gather`). The collectives go through the strategy, so
they keep its timeout and error messages.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["gather_with_gradient"]

# A process group, a 1-D DeviceMesh or None (collectives.py's Group; kept opaque here, so this
# module needs nothing of the class that calls it)
Group = Any


class Collectives(Protocol):
    """What the gather needs of the strategy (collectives.py's Collectives)."""

    @property
    def is_distributed(self) -> bool: ...

    def group_rank(self, group: Group = None) -> int: ...

    def all_gather(self, tensor: torch.Tensor, *, group: Group = None) -> torch.Tensor: ...

    def all_reduce_(
        self, tensor: torch.Tensor, op: Any = ..., *, name: str = ..., group: Group = ...
    ) -> torch.Tensor: ...


class _GatherWithGradient(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        strategy: Collectives,
        group: Group,
        index: int,
    ) -> torch.Tensor:
        ctx.strategy, ctx.group, ctx.index = strategy, group, index
        return strategy.all_gather(tensor, group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        summed = ctx.strategy.all_reduce_(
            grad.contiguous().clone(), "sum", name="all_gather backward", group=ctx.group
        )
        return summed[ctx.index], None, None, None


def gather_with_gradient(strategy: Collectives, tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """`strategy.all_gather(tensor, differentiable=True)`; see the module docstring."""
    if not strategy.is_distributed:
        return tensor.unsqueeze(0)
    index = strategy.group_rank(group)
    return _GatherWithGradient.apply(tensor, strategy, group, index)
