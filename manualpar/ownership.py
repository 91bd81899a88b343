"""Which builder owns which parameter, so builders compose without touching each other's parts.

Every builder (ddp, fsdp, shard_embeddings, ...) calls `claim` on the module it takes over. A
parameter belongs to exactly one builder; claiming it twice raises BuilderError. Builders skip
parameters that others own (DDP ignores them, FSDP leaves them unsharded), and
`ParallelModule.parameters_by_owner` lists them for the right optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from manualpar.errors import BuilderError

__all__ = ["claim", "mark_replaced", "owned_by_others", "owner_of", "replaced_by", "stale_reason"]

_OWNER = "_manualpar_owner"
_REPLACED = "_manualpar_replaced_by"


def owner_of(param: torch.Tensor) -> str | None:
    """The builder that owns `param`, or None if it is still a plain parameter."""
    return getattr(param, _OWNER, None)


def claim(
    module: nn.Module,
    builder: str,
    params: Iterable[tuple[str, nn.Parameter]] | None = None,
) -> None:
    """Record `builder` as the owner of the given (default: all unowned) parameters of `module`.

    Raises BuilderError if the module itself was already wrapped by a builder.
    """
    previous = getattr(module, "_manualpar_builder", None)
    if previous is not None:
        raise BuilderError(
            f"{builder}(): module {type(module).__name__} was already set up by {previous}(); "
            "call each builder once per module, on disjoint submodules"
        )
    object.__setattr__(module, "_manualpar_builder", builder)
    for _, param in params if params is not None else unowned_parameters(module):
        setattr(param, _OWNER, builder)


def unowned_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if owner_of(p) is None]


def owned_by_others(module: nn.Module, builder: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters of `module` another builder already took (to be ignored by `builder`)."""
    return [
        (n, p)
        for n, p in module.named_parameters()
        if owner_of(p) is not None and owner_of(p) != builder
    ]


def mark_replaced(params: Iterable[torch.Tensor], builder: str) -> None:
    """Flag parameters a builder swapped for new ones (e.g. sharded): an optimizer still holding
    them was created before setup and would update tensors the model no longer uses."""
    for param in params:
        setattr(param, _REPLACED, builder)


def replaced_by(param: torch.Tensor) -> str | None:
    return getattr(param, _REPLACED, None)


def stale_reason(param: torch.Tensor) -> str | None:
    """Why an optimizer must not hold `param` (on meta, or swapped out by a builder), or None."""
    if param.is_meta:
        return "is still on the meta device"
    builder = replaced_by(param)
    if builder is not None:
        return f"was replaced by {builder}() (the model now trains a new tensor)"
    return None
