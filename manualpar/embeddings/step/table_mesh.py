"""Which ranks a sharded collection exchanges with: the whole job, or one row of a 2-D mesh.

    mesh = strategy.mesh(replicate=2, shard=2)        # ranks [[0, 1], [2, 3]]
    emb = shard_embeddings(ebc, strategy, plan, optimizer, mesh=mesh)

Dim 0 replicates, dim 1 shards (their names are free). The plan is for the shard dim: each row
of the mesh holds a whole sharded copy of the tables, ids, pooled rows and output gradients
travel only inside the row (mesh[1]: with node-major ranks and a shard dim no larger than a
node, inside a node), and the rows' table gradients are summed across the column (mesh[0],
replica_combine.py) before the fused update, so every copy applies the same update.

A 1-D mesh over the whole job is the same as no mesh. A 1-D mesh over part of the job (one dim
of a 2-D mesh) is refused: each replica would train its own tables apart, silently diverging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh

from manualpar.embeddings.config import BUILDER
from manualpar.errors import BuilderError, PlanError
from manualpar.strategy.mesh import check_mesh, describe_mesh

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["TableMesh", "table_mesh"]


@dataclass(frozen=True)
class TableMesh:
    """The groups of one sharded collection. `shard`/`replicate` are the 1-D meshes its
    collectives take as `group=` (None: the strategy's own group / no replicas)."""

    shard: DeviceMesh | None
    replicate: DeviceMesh | None
    shard_rank: int  # this rank's index in its shard group (the plan's rank)
    shard_size: int  # ranks per shard group (the plan's world size)
    replicas: int  # shard groups (rows of the mesh)
    replica_rank: int  # which row this rank is in
    group_ranks: tuple[int, ...]  # the job ranks of this rank's shard group, in group order
    world_size: int  # ranks of the job (every rank's loss counts in the gradient)
    description: str = ""  # the mesh, for errors ("" without one)

    @property
    def combines(self) -> bool:
        """Whether table gradients are summed across replicas before the update."""
        return self.replicas > 1

    @property
    def primary(self) -> bool:
        """Whether this rank's blocks are the ones a checkpoint writes (the first replica's)."""
        return self.replica_rank == 0

    def check_plan_size(self, plan_world_size: int) -> None:
        """A plan must be made for the shard dim: refuse one for the whole job (or another)."""
        if self.replicate is None or plan_world_size == self.shard_size:
            return
        raise PlanError(
            f"{BUILDER}(): the plan is for {plan_world_size} ranks, but the shard dim of the "
            f"mesh {self.description} has {self.shard_size}; tables are sharded over the shard "
            f"dim and replicated over dim 0, so make the plan for {self.shard_size} ranks "
            f"(plan='auto' does, or plan_tables(tables, {self.shard_size}))"
        )


def table_mesh(mesh: object, strategy: ManualParallelStrategy) -> TableMesh:
    """The layout `shard_embeddings(mesh=...)` gets; BuilderError for a mesh it cannot use."""
    world = strategy.world_size
    if mesh is None:
        return TableMesh(None, None, strategy.rank, world, 1, 0, tuple(range(world)), world)
    if isinstance(mesh, DeviceMesh) and mesh.ndim > 2:
        raise BuilderError(
            f"{BUILDER}(): takes a 1-D or 2-D (replicate, shard) mesh, got a {mesh.ndim}-D mesh "
            f"{describe_mesh(mesh)}; tables shard over one dim and replicate over one other: "
            "build strategy.mesh(replicate=R, shard=S) for them (other dims, e.g. tensor "
            "parallel ones, are folded into those two)"
        )
    checked = check_mesh(mesh, BUILDER, (1, 2), world)
    described = describe_mesh(checked)
    if checked.size() != world:
        raise BuilderError(
            f"{BUILDER}(mesh={described}): the mesh covers {checked.size()} of the job's {world} "
            "ranks, so each replica group would train its own copy of the tables apart (their "
            "values would drift). Pass the 2-D mesh itself, e.g. mesh=strategy.mesh(replicate=R, "
            "shard=S): tables shard over dim 1, replicate over dim 0 and train as one"
        )
    grid = checked.mesh.tolist()
    if checked.ndim == 1:
        return TableMesh(
            checked,
            None,
            strategy.group_rank(checked),
            world,
            1,
            0,
            tuple(grid),
            world,
            described,
        )
    names = checked.mesh_dim_names
    replicate = checked[names[0]] if names else None
    shard = checked[names[1]] if names else None
    if replicate is None or shard is None:
        raise BuilderError(
            f"{BUILDER}(mesh=...): the 2-D mesh has no dim names; build it with "
            "strategy.mesh(replicate=R, shard=S)"
        )
    row = next(r for r in grid if strategy.rank in r)
    return TableMesh(
        shard,
        replicate,
        strategy.group_rank(shard),
        len(row),
        len(grid),
        strategy.group_rank(replicate),
        tuple(row),
        world,
        described,
    )
