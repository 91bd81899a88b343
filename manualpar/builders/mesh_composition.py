"""Which mesh a builder runs over, and whether builders over the same parameters compose.

Every builder takes `mesh=None` (the strategy's whole group) or a DeviceMesh from
`strategy.mesh(...)`. Parameters remember the mesh of the builder that claimed them (see
`manualpar.ownership.mesh_of`): fsdp may shard tp's parameters when its mesh is another dim of
the same mesh (2-D DTensors, as torchtitan composes them); any other overlap of builders on
different meshes is refused here with both meshes named.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from manualpar.errors import BuilderError
from manualpar.ownership import builder_of, mesh_of, owner_of
from manualpar.strategy import ManualParallelStrategy
from manualpar.strategy.mesh import check_mesh, describe_mesh

__all__ = ["builder_mesh", "composes_with_tp", "mesh_label", "refuse_taken", "refuse_tp_params"]

TP = "tp"


def builder_mesh(
    mesh: object, strategy: ManualParallelStrategy, builder: str, ndims: Sequence[int]
) -> DeviceMesh | None:
    """None for the strategy's whole group, else the checked mesh (BuilderError if it has the
    wrong number of dims or spans more ranks than the strategy)."""
    if mesh is None:
        return None
    return check_mesh(mesh, builder, ndims, strategy.world_size)


def mesh_label(mesh: DeviceMesh | None, world_size: int | None = None) -> str:
    """'mesh (replicate=2, shard=2)', or 'the whole group (world=4)' for mesh=None."""
    if mesh is None:
        size = f" (world={world_size})" if world_size is not None else ""
        return f"the strategy's whole group{size}"
    return f"mesh {describe_mesh(mesh)}"


def refuse_taken(module: nn.Module, builder: str, mesh: DeviceMesh | None, world_size: int) -> None:
    """BuilderError if another builder (or this one, earlier) already took `module`, naming the
    earlier builder and mesh and this call's mesh."""
    previous = builder_of(module)
    if previous is None:
        return
    before = mesh_label(mesh_of(module), world_size)
    now = mesh_label(mesh, world_size)
    where = f"{previous}() ran on {before}" + (
        f", this {builder}() call on {now}" if before != now else ""
    )
    raise BuilderError(
        f"{builder}(): module {type(module).__name__} was already set up by {previous}(); call "
        f"each builder once per module, on disjoint submodules ({where}; for HSDP pass the 2-D "
        "mesh to one fsdp() call; for tensor parallel call tp() first, then fsdp() on another "
        "dim of the same mesh)"
    )


def refuse_tp_params(
    named: Iterable[tuple[str, torch.Tensor]],
    builder: str,
    mesh: DeviceMesh | None,
    world_size: int,
) -> None:
    """ddp and zero replicate full parameters: tp's shards cannot be handed to them."""
    for name, param in named:
        if owner_of(param) == TP:
            raise BuilderError(
                f"{builder}(): parameter {name if name.isdigit() else repr(name)} "
                f"{tuple(param.shape)} is sharded by tp() over "
                f"{mesh_label(mesh_of(param), world_size)}, but {builder}() would replicate it "
                f"over {mesh_label(mesh, world_size)}; shard the data-parallel dim of tp's "
                "parameters with fsdp(module, strategy, mesh=mesh['dp']) (another dim of the "
                f"same mesh), or leave the tp part out of {builder}()"
            )


def composes_with_tp(tp_mesh: DeviceMesh | None, mesh: DeviceMesh | None) -> bool:
    """True if `mesh` is other dims of the same root mesh as tp's 1-D `tp_mesh`."""
    if tp_mesh is None or mesh is None:
        return False
    root = tp_mesh._get_root_mesh()
    if mesh._get_root_mesh() != root or root is tp_mesh:
        return False
    tp_dims = set(tp_mesh.mesh_dim_names or ())
    dims = set(mesh.mesh_dim_names or ())
    return bool(tp_dims) and bool(dims) and not (tp_dims & dims)
