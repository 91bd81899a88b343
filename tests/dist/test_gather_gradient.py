"""strategy.all_gather(differentiable=True) on real processes, against sums computed by hand
and against one process training two towers over the global batch."""

from __future__ import annotations

import pytest
import torch
from gather_cases import distributed_gradients, gathered_gradient, reference_gradients

from manualpar.testing import run_distributed


@pytest.mark.parametrize("world", [2, 3])
def test_each_slice_gets_the_sum_of_its_gradients(world: int) -> None:
    results = run_distributed(gathered_gradient, world_size=world)
    used_by_all = sum(r + 1.0 for r in range(world))  # rank r weighs every slice s by (r+1)(s+1)
    for rank, result in enumerate(results):
        assert result["values"] == [[float(r)] * 3 for r in range(world)]
        assert result["grad"] == [used_by_all * (rank + 1)] * 3


def test_in_batch_negatives_with_ddp_match_the_global_batch() -> None:
    """Loss per rank = mean over its queries; DDP averages over ranks: the global-batch mean."""
    expected = reference_gradients()
    for result in run_distributed(distributed_gradients, world_size=2):
        assert result.keys() == expected.keys()
        for name, grad in expected.items():
            torch.testing.assert_close(torch.tensor(result[name]), torch.tensor(grad), msg=name)
