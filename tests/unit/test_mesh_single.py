"""strategy.mesh() in one process, and the errors of bad mesh requests."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from manualpar import ManualParallelStrategy
from manualpar.environment import ClusterEnvironment
from manualpar.errors import BuilderError, MeshError
from manualpar.strategy.mesh import check_mesh, mesh_shape


def test_world_size_one_gets_a_real_mesh_and_collectives_over_its_dims() -> None:
    with ManualParallelStrategy(accelerator="cpu") as strategy:
        mesh = strategy.mesh(replicate=1, shard=1)
        assert isinstance(mesh, DeviceMesh)
        assert mesh.mesh_dim_names == ("replicate", "shard")
        assert strategy.mesh(replicate=1, shard=1) is mesh
        value = strategy.all_reduce(torch.tensor(3.0), "sum", group=mesh["shard"])
        assert value.item() == 3.0
        assert strategy.group_size(mesh["shard"]) == 1
        with pytest.raises(ValueError, match=r"pass one dim, e.g. group=mesh\['replicate'\]"):
            strategy.all_reduce(torch.tensor(1.0), group=mesh)
    assert not torch.distributed.is_initialized()  # the one-rank group went with teardown


def test_sizes_must_multiply_to_the_world_size() -> None:
    with pytest.raises(MeshError, match=r"replicate=2 x shard=3 = 6 ranks, but the world has 4"):
        mesh_shape({"replicate": 2, "shard": 3}, 4)
    with pytest.raises(MeshError, match="name at least one dim"):
        mesh_shape({}, 4)
    with pytest.raises(MeshError, match="dim 'shard' has size 0"):
        mesh_shape({"replicate": 4, "shard": 0}, 4)
    with (
        ManualParallelStrategy(accelerator="cpu") as strategy,
        pytest.raises(MeshError, match="= 2 ranks, but the world has 1"),
    ):
        strategy.mesh(shard=2)


@pytest.mark.parametrize("name", ["", "a b", "2d", "shard-1"])
def test_a_dim_name_must_be_an_identifier(name: str) -> None:
    with pytest.raises(MeshError) as caught:
        mesh_shape({name: 1}, 1)
    assert str(caught.value) == (
        f"mesh(): dim name {name!r} is not a name; name dims like Python identifiers (letters, "
        "digits and underscores, not starting with a digit), e.g. mesh(replicate=2, shard=2)"
    )
    with ManualParallelStrategy(accelerator="cpu") as strategy, pytest.raises(MeshError):
        strategy.mesh(**{name: 1})


def test_node_layout_is_checked_against_the_launcher() -> None:
    env = ClusterEnvironment(source="user")
    with ManualParallelStrategy(env, accelerator="cpu") as strategy:
        assert strategy.mesh(node=1, local=1).mesh_dim_names == ("node", "local")
        with pytest.raises(MeshError, match="'node' must come before 'local'"):
            strategy.mesh(local=1, node=1)


def test_builders_refuse_meshes_of_the_wrong_rank() -> None:
    with ManualParallelStrategy(accelerator="cpu") as strategy:
        mesh = strategy.mesh(a=1, b=1, c=1)
        with pytest.raises(BuilderError, match=r"ddp\(\): takes a 1-D mesh, got a 3-D mesh \(a=1"):
            check_mesh(mesh, "ddp", (1,), strategy.world_size)
        with pytest.raises(BuilderError, match="expected a DeviceMesh"):
            check_mesh("shard", "ddp", (1,), strategy.world_size)


def test_a_dim_that_does_not_exist_names_the_ones_that_do() -> None:
    with ManualParallelStrategy(accelerator="cpu") as strategy:
        mesh = strategy.mesh(replicate=1, shard=1)
        with pytest.raises(KeyError, match=r"Valid mesh_dim_names are \['replicate', 'shard'\]"):
            mesh["nope"]
