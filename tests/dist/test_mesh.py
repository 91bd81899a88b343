"""strategy.mesh() on 4 real ranks laid out as 2 nodes x 2 processes."""

from __future__ import annotations

import pytest

from manualpar.testing import run_distributed
from tests.support.mesh_cases import mesh_layout, mismatched_meshes

pytestmark = pytest.mark.timeout(120)


def test_named_mesh_dims_and_collectives_over_a_dim() -> None:
    results = run_distributed(mesh_layout, world_size=4, local_world_size=2)
    for rank, seen in enumerate(results):
        assert seen["grid"] == [[0, 1], [2, 3]]
        assert seen["names"] == ("replicate", "shard")
        assert seen["same"]
        node, local = divmod(rank, 2)
        assert (seen["node_rank"], seen["local_rank"], seen["num_nodes"]) == (node, local, 2)
        assert seen["shard_rank"] == local
        # mesh["shard"] is this node's pair; mesh["replicate"] the same local rank on each node
        assert seen["shard_sum"] == {0: 1, 1: 5}[node]
        assert seen["replicate_sum"] == {0: 2, 1: 4}[local]
        assert seen["gathered"] == [2 * node, 2 * node + 1]
        assert seen["node_grid"] == [[0, 1], [2, 3]]
        assert "the launcher runs 2 processes per node; use local=2" in seen["wrong_layout"]


def test_ranks_asking_for_different_meshes_are_refused_naming_each_ranks_dims() -> None:
    """Dims in another order used to leave one rank waiting past the timeout, and dims named
    differently passed silently; both now raise MeshError on every rank at once."""
    results = run_distributed(mismatched_meshes, world_size=2, collective_timeout=15)
    advice = "every rank must call mesh() with the same dim names, sizes and order (outer to inner)"
    for seen in results:
        assert seen["errors"] == [
            "mesh(): the ranks asked for different meshes (rank 0: (replicate=1, shard=2), "
            f"rank 1: (shard=2, replicate=1)); {advice}",
            "mesh(): the ranks asked for different meshes (rank 0: (x=2), rank 1: (y=2)); "
            + advice,
        ]
        assert seen["total"] == 2.0
