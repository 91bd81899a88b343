"""Which builder owns which parameter, so builders compose without touching each other's parts.

Every builder (ddp, fsdp, shard_embeddings, ...) calls `claim` on the module it takes over. A
parameter belongs to exactly one builder; claiming a module twice raises BuilderError. Builders
skip parameters and submodules that others own (DDP ignores them, FSDP leaves them unsharded).
A builder that updates its parameters itself (a fused optimizer inside backward) claims them
with `trains_itself=True`, so `ParallelModule.dense_parameters()` leaves them out of the dense
optimizer without knowing any builder by name. A builder that runs over a device mesh records it
with the claim (`mesh_of`), so a later builder over the same parameters can check that the two
meshes compose and name both when they do not.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from manualpar.errors import BuilderError

__all__ = [
    "builder_of",
    "claim",
    "claimed_submodules",
    "mark_replaced",
    "mesh_of",
    "owned_by_others",
    "owner_of",
    "replaced_by",
    "stale_reason",
    "trained_by_owner",
    "unowned_parameters",
]

_OWNER = "_manualpar_owner"  # on a parameter: the builder that owns it
_TRAINS_ITSELF = "_manualpar_trained_by_owner"  # on a parameter: its owner updates it
_BUILDER = "_manualpar_builder"  # on a module: the builder that took it over
_REPLACED = "_manualpar_replaced_by"  # on a parameter: the builder that swapped it out
_MESH = "_manualpar_mesh"  # on a module or parameter: the device mesh its builder ran over


def owner_of(param: torch.Tensor) -> str | None:
    """The builder that owns `param`, or None if it is still a plain parameter."""
    return getattr(param, _OWNER, None)


def trained_by_owner(param: torch.Tensor) -> bool:
    """True if the owning builder updates `param` itself (no dense optimizer may hold it)."""
    return bool(getattr(param, _TRAINS_ITSELF, False))


def mesh_of(obj: nn.Module | torch.Tensor) -> DeviceMesh | None:
    """The mesh the builder that claimed `obj` ran over (None: the strategy's whole group)."""
    return getattr(obj, _MESH, None)


def builder_of(module: nn.Module) -> str | None:
    """The builder that took `module` over, or None."""
    return getattr(module, _BUILDER, None)


def claim(
    module: nn.Module,
    builder: str,
    params: Iterable[tuple[str, nn.Parameter]] | None = None,
    *,
    trains_itself: bool = False,
    mesh: DeviceMesh | None = None,
    take_module: bool = True,
) -> None:
    """Record `builder` as the owner of the given (default: all unowned) parameters of `module`,
    with the mesh it ran over. `take_module=False` claims only the parameters (a builder such as
    tp that leaves the module itself to another builder).

    Raises BuilderError if the module itself was already taken over by a builder.
    """
    previous = builder_of(module)
    if previous is not None:
        raise BuilderError(
            f"{builder}(): module {type(module).__name__} was already set up by {previous}(); "
            "call each builder once per module, on disjoint submodules"
        )
    if take_module:
        object.__setattr__(module, _BUILDER, builder)
        object.__setattr__(module, _MESH, mesh)
    for _, param in params if params is not None else unowned_parameters(module):
        setattr(param, _OWNER, builder)
        setattr(param, _MESH, mesh)
        if trains_itself:
            setattr(param, _TRAINS_ITSELF, True)


def unowned_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if owner_of(p) is None]


def owned_by_others(module: nn.Module, builder: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters of `module` another builder already took (to be ignored by `builder`)."""
    return [
        (n, p)
        for n, p in module.named_parameters()
        if owner_of(p) is not None and owner_of(p) != builder
    ]


def claimed_submodules(module: nn.Module) -> list[str]:
    """Qualified names (each ending in '.') of the strict submodules a builder took over."""
    return [
        name + "."
        for name, sub in module.named_modules()
        if sub is not module and builder_of(sub) is not None
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
