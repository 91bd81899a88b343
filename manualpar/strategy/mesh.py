"""Named device meshes over the strategy's ranks, and how builders check the mesh they get.

    mesh = strategy.mesh(replicate=2, shard=2)  # outer to inner: ranks [[0, 1], [2, 3]]
    mesh["shard"]  # this rank's 1-D row: the ranks it shards with

Ranks fill the mesh row-major (the last dim varies fastest), as torch's `init_device_mesh` does;
launchers number ranks node by node, so the inner dims stay inside a node when their product
divides the processes per node. `strategy.mesh(node=N, local=L)` states that layout and is
checked against the launcher's.

The dim groups are made here with the strategy's collective timeout (torch's own mesh init would
give them its 30-minute default) and wrapped by `DeviceMesh.from_group`, so the result is a plain
torch DeviceMesh that FSDP2, DTensor and `parallelize_module` take as is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from manualpar.errors import BuilderError, MeshError

__all__ = [
    "NODE_DIMS",
    "build_mesh",
    "check_mesh",
    "check_same_dims",
    "describe_mesh",
    "mesh_shape",
]

NODE_DIMS = ("node", "local")  # the dim names that state the launcher's layout


def mesh_shape(dims: Mapping[str, int], world_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Validated (names, sizes) of `strategy.mesh(**dims)`; MeshError names what is wrong."""
    if not dims:
        raise MeshError(
            f"mesh(): name at least one dim, e.g. mesh(world={world_size}) or "
            f"mesh(replicate=..., shard=...) whose sizes multiply to the world size {world_size}"
        )
    for name, size in dims.items():
        if not name.isidentifier():
            raise MeshError(
                f"mesh(): dim name {name!r} is not a name; name dims like Python identifiers "
                "(letters, digits and underscores, not starting with a digit), e.g. "
                "mesh(replicate=2, shard=2)"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MeshError(f"mesh(): dim {name!r} has size {size!r}; sizes are integers >= 1")
    names, sizes = tuple(dims), tuple(dims.values())
    if math.prod(sizes) != world_size:
        described = " x ".join(f"{n}={s}" for n, s in dims.items())
        raise MeshError(
            f"mesh(): {described} = {math.prod(sizes)} ranks, but the world has {world_size}; "
            f"choose sizes that multiply to {world_size} (launch {math.prod(sizes)} processes "
            "or change the sizes)"
        )
    return names, sizes


def check_same_dims(requested: Sequence[tuple[tuple[str, object], ...]]) -> None:
    """Every rank's `mesh(**dims)` request (names, sizes and order), as all-gathered: they must
    be equal, or the ranks would make different groups and wait on each other until the
    timeout (or, with names alone differing, silently disagree on what each dim is)."""
    if any(dims != requested[0] for dims in requested):
        described = ", ".join(
            f"rank {rank}: ({', '.join(f'{n}={s!r}' for n, s in dims)})"
            for rank, dims in enumerate(requested)
        )
        raise MeshError(
            f"mesh(): the ranks asked for different meshes ({described}); every rank must call "
            "mesh() with the same dim names, sizes and order (outer to inner)"
        )


def check_node_layout(
    names: Sequence[str], sizes: Sequence[int], num_nodes: int, local_world_size: int
) -> None:
    """`node=` and `local=` must be the launcher's node count and processes per node."""
    layout = dict(zip(names, sizes, strict=True))
    if "local" in layout and layout["local"] != local_world_size:
        raise MeshError(
            f"mesh(local={layout['local']}): the launcher runs {local_world_size} processes per "
            f"node; use local={local_world_size} (or another dim name for a layout of your own)"
        )
    if "node" in layout and layout["node"] != num_nodes:
        raise MeshError(
            f"mesh(node={layout['node']}): the launcher started {num_nodes} node(s) of "
            f"{local_world_size} processes; use node={num_nodes}"
        )
    if (
        "node" in layout
        and "local" in layout
        and list(names).index("node") > list(names).index("local")
    ):
        raise MeshError("mesh(): 'node' must come before 'local' (dims go outer to inner)")


def rank_grid(sizes: Sequence[int], world_ranks: Sequence[int]) -> torch.Tensor:
    """The mesh's global ranks, row-major."""
    return torch.tensor(list(world_ranks), dtype=torch.int).view(*sizes)


def build_mesh(
    device_type: str,
    names: Sequence[str],
    grid: torch.Tensor,
    timeout: timedelta,
) -> DeviceMesh:
    """A DeviceMesh over `grid` with one process group per row of each dim (every rank of the
    default group must call this, with the same arguments and in the same order)."""
    groups: list[dist.ProcessGroup] = []
    me = dist.get_rank()
    for dim in range(grid.dim()):
        rows = grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()
        mine = None
        for row in rows:  # every rank creates every group, in the same order (torch requires it)
            group = dist.new_group(row, timeout=timeout)
            if me in row:
                mine = group
        assert mine is not None  # the grid holds every rank
        groups.append(mine)
    return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=tuple(names))


def describe_mesh(mesh: DeviceMesh) -> str:
    """'(replicate=2, shard=2)' for errors and logs."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True)) + ")"


def check_mesh(mesh: object, builder: str, ndims: Sequence[int], world_size: int) -> DeviceMesh:
    """The mesh a builder was given, if it is a DeviceMesh of an accepted number of dims over
    this job's ranks; BuilderError naming the builder and what it takes otherwise."""
    if not isinstance(mesh, DeviceMesh):
        raise BuilderError(
            f"{builder}(mesh=...): expected a DeviceMesh from strategy.mesh(...), got "
            f"{type(mesh).__name__}"
        )
    if mesh.ndim not in ndims:
        takes = " or ".join(f"{n}-D" for n in ndims)
        hint = "pick a dim, e.g. mesh['shard']" if 1 in ndims else "pass two dims"
        raise BuilderError(
            f"{builder}(): takes a {takes} mesh, got a {mesh.ndim}-D mesh {describe_mesh(mesh)}; "
            f"{hint}"
        )
    if mesh.size() > world_size:
        raise BuilderError(
            f"{builder}(): the mesh {describe_mesh(mesh)} spans {mesh.size()} ranks but the "
            f"strategy has {world_size}; build it with this strategy's mesh()"
        )
    return mesh
