"""Rank functions for the mesh tests (module level, so run_distributed can pickle them)."""

from __future__ import annotations

from typing import Any

import torch

from manualpar import ManualParallelStrategy
from manualpar.errors import MeshError


def mesh_layout() -> dict[str, Any]:
    """What a rank sees of strategy.mesh(replicate=2, shard=2) and mesh(node=2, local=2)."""
    with ManualParallelStrategy() as strategy:
        mesh = strategy.mesh(replicate=2, shard=2)
        same = strategy.mesh(replicate=2, shard=2) is mesh
        shard_sum = strategy.all_reduce(
            torch.tensor(float(strategy.rank)), "sum", group=mesh["shard"]
        )
        replicate_sum = strategy.all_reduce(
            torch.tensor(float(strategy.rank)), "sum", group=mesh["replicate"]
        )
        gathered = strategy.all_gather(torch.tensor([strategy.rank]), group=mesh["shard"])
        nodes = strategy.mesh(node=2, local=2)
        try:
            strategy.mesh(node=1, local=4)
            wrong_layout = ""
        except MeshError as error:
            wrong_layout = str(error)
        return {
            "grid": mesh.mesh.tolist(),
            "names": mesh.mesh_dim_names,
            "same": same,
            "shard_sum": shard_sum.item(),
            "replicate_sum": replicate_sum.item(),
            "shard_rank": strategy.group_rank(mesh["shard"]),
            "gathered": gathered.flatten().tolist(),
            "node_rank": strategy.node_rank,
            "local_rank": strategy.local_rank,
            "num_nodes": strategy.num_nodes,
            "node_grid": nodes.mesh.tolist(),
            "wrong_layout": wrong_layout,
        }


def mismatched_meshes() -> dict[str, Any]:
    """Rank 1 asks for other meshes than rank 0 (dims in another order, then another name):
    the errors each rank sees, then a mesh both agree on, which still works."""
    errors = []
    with ManualParallelStrategy() as strategy:
        first = strategy.rank == 0
        for dims in (
            {"replicate": 1, "shard": 2} if first else {"shard": 2, "replicate": 1},
            {"x": 2} if first else {"y": 2},
        ):
            try:
                strategy.mesh(**dims)
                errors.append("")
            except MeshError as error:
                errors.append(str(error))
        mesh = strategy.mesh(replicate=1, shard=2)
        total = strategy.all_reduce(torch.tensor(1.0), "sum", group=mesh["shard"]).item()
    return {"errors": errors, "total": total}
