"""clip_grad_norm_: one global gradient norm over a model mixed from several builders.

torch's `clip_grad_norm_` needs all gradients to be plain tensors, or all DTensors on one mesh;
a model with `ddp` parts (plain tensors) and `fsdp` parts (DTensors) has both and fails
("got mixed torch.Tensor and DTensor"). Here each kind is normed on its own and the norms are
combined: a DTensor group (one mesh and placements) gives its true norm over all its shards,
counting replicated dims once (DTensor reduces only over the dims it is sharded on); a plain
gradient is taken as replicated (DDP, ZeRO: every rank holds the same averaged gradient), so it
is counted once, as is. Every rank gets the same norm and scales its gradients by the same
factor, so replicas stay identical.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from manualpar.dtensors import is_dtensor, local_part
from manualpar.errors import BuilderError, NonFiniteError

__all__ = ["clip_grad_norm_", "clip_grads_with_norm_", "total_grad_norm"]


@torch.no_grad()
def total_grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0
) -> torch.Tensor:
    """The `norm_type` norm of all gradients of `parameters` together, the same on every rank."""
    grads = [p.grad for p in _as_list(parameters) if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if is_dtensor(grad) else grad.device
        groups.setdefault(key, []).append(grad)
    device = _local(grads[0]).device
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        norms.append(norm.to(device=device, dtype=torch.float32))
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        return stacked.max()
    return torch.linalg.vector_norm(stacked, norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale the gradients of `parameters` so their global norm is at most `max_norm`.

    As `torch.nn.utils.clip_grad_norm_`, for plain tensors and DTensors (FSDP, HSDP, tensor
    parallel, any mesh) mixed; returns the norm before clipping. Sharded tables are not here:
    they have no `.grad` (their fused optimizer updates them inside backward).
    """
    if max_norm <= 0 or math.isnan(max_norm):
        raise BuilderError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    params = _as_list(parameters)
    total = total_grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise NonFiniteError(
            f"clip_grad_norm_: the total gradient norm is {total.item()} (norm_type "
            f"{norm_type}); a NaN or inf gradient reached the optimizer. Find it with "
            "mp.check_finite, or pass error_if_nonfinite=False to clip anyway"
        )
    clip_grads_with_norm_(params, max_norm, total)
    return total


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor
) -> None:
    """Scale the gradients of `parameters` by max_norm / total_norm (at most 1), for a caller
    that already has their global norm (`total_grad_norm`): no second pass over them."""
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in [_local(p.grad) for p in _as_list(parameters) if p.grad is not None]:
        grad.mul_(scale.to(grad.device))


def _as_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: what scaling writes to."""
    return local_part(tensor)
