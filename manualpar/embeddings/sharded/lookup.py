"""The lookup of a prepared batch as one autograd node: forward runs the sharded step's
forward phases, backward its backward phases, which update the tables in place (the fused
optimizer): no gradient of a table ever forms.

`anchor` is a leaf that requires grad, so the backward (a collective) runs on every rank, even
one that holds no table.
"""

from __future__ import annotations

from typing import Any

import torch

from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.sharded.batch_inputs import PreparedBatch
from manualpar.embeddings.step.results import RoutedIds
from manualpar.embeddings.step.sharded_step import ShardedStep

__all__ = ["lookup"]


def lookup(anchor: torch.Tensor, step: ShardedStep, batch: PreparedBatch) -> torch.Tensor:
    """The pooled values (bags, total dim) of `batch`; differentiable through `anchor`."""
    grad = torch.is_grad_enabled()
    out: torch.Tensor = _EmbeddingLookup.apply(anchor, step, batch.bags, batch.routed, grad)
    return out


class _EmbeddingLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        step: ShardedStep,
        bags: SparseFeatures,
        routed: RoutedIds | None,
        grad_enabled: bool,
    ) -> torch.Tensor:
        out, saved = step.forward(bags, routed)
        ctx.step, ctx.saved = step, saved
        if not (saved.trains and grad_enabled):  # no backward will unpin its rows
            step.release(saved)
        if not saved.trains:  # every table frozen: no backward, on every rank
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None, None]:
        # an empty batch's gradient may be an expanded (stride 0) tensor, which contiguous()
        # keeps as it is (it holds no element): the kernels need real row strides
        grad = grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)
        ctx.step.backward(grad, ctx.saved)
        ctx.saved = None
        return None, None, None, None, None
