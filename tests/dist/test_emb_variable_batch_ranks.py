"""A batch per feature (deduplicated bags, variable_batch_cases.py) on real gloo processes:
exact against the expanded batch it stands for, on every placement and in the pipeline.

Per case, on every rank: the step-0 pooled output equals, bit for bit, that of the same model
fed the expanded batch (each bag is pooled by the same kernel from the same ids, then copied to
its samples); after STEPS steps the tables equal the expanded run's within float32 rounding
(the gradient of a bag is summed over its samples before it travels, so the row gradients add
the same terms in another order: measured at most 5e-7, a few units in the last place of
values up to 1) and, like the expanded run's, the float64 reference's within 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from embedding_cases import mixed_plan, uniform_plan
from variable_batch_cases import float64_reference, train_sharded

from manualpar.embeddings import EmbeddingPlan
from manualpar.testing import run_distributed

BATCHES = [5, 3, 4, 2]


def check(per_rank: list[list[dict]], opt_name: str, world: int, weighted: bool, what: str) -> None:
    first, tables = float64_reference(opt_name, BATCHES[:world], weighted)
    for rank, cases in enumerate(per_rank):
        for case in cases:
            got, twin = case["variable"], case["expanded"]
            where = f"{what}, rank {rank}"
            assert torch.equal(got["first"], twin["first"]), f"{where}: pooled output"
            torch.testing.assert_close(
                got["first"].double(), first[rank % len(first)], rtol=0, atol=1e-6, msg=where
            )
            for name, expected in tables.items():
                for run in (got, twin):
                    torch.testing.assert_close(
                        run["tables"][name].double(), expected, rtol=0, atol=1e-6, msg=where
                    )
                torch.testing.assert_close(
                    got["tables"][name], twin["tables"][name], rtol=0, atol=1e-6, msg=where
                )
                for key, value in twin["state"][name].items():
                    torch.testing.assert_close(
                        got["state"][name][key], value, rtol=1e-5, atol=1e-6, msg=where
                    )


@pytest.mark.parametrize(("world", "opt_name"), [(2, "adam"), (3, "rowwise")])
def test_every_placement_equals_the_expanded_batch(world: int, opt_name: str) -> None:
    """table-, row-, column-, table-row-wise and data-parallel tables in one plan (mixed_plan),
    with per-id weights, mean pooling, bags no sample reads (Adam would step their rows)."""
    plans: list[EmbeddingPlan] = [mixed_plan(world)]
    per_rank = run_distributed(
        train_sharded, world, args=(plans, opt_name, BATCHES[:world], True), timeout=120
    )
    check(per_rank, opt_name, world, True, f"mixed plan, {world} ranks, {opt_name}")


def test_pipeline_and_a_2d_mesh_equal_the_expanded_batch() -> None:
    """Through TrainPipeline (the input dist of each next batch runs ahead), and on a 2 x 2
    mesh (tables sharded over 2 ranks, replicated over 2): the plain loop's numbers."""
    pipelined = run_distributed(
        train_sharded,
        2,
        args=([mixed_plan(2)], "adagrad", BATCHES[:2]),
        kwargs={"pipelined": True},
        timeout=120,
    )
    check(pipelined, "adagrad", 2, False, "pipeline")
    meshed = run_distributed(
        train_sharded,
        4,
        args=([mixed_plan(2), uniform_plan("row_wise", 2)], "sgd", BATCHES),
        kwargs={"mesh": {"replicate": 2, "shard": 2}},
        timeout=180,
    )
    check(meshed, "sgd", 4, False, "2 x 2 mesh")
