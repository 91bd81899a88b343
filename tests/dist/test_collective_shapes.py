"""Collectives called with different shapes on different ranks: unchecked, gloo silently sends
only the common prefix; checked, every rank raises naming each rank's shape.
docs/reliability.md lists the case with its node id.
"""

from __future__ import annotations

import torch

import manualpar as mp
from manualpar.testing import run_distributed


def _broadcast_mismatch(checked: bool) -> list[float]:
    strategy = mp.ManualParallelStrategy(check_collectives=checked)
    tensor = torch.zeros(2) if strategy.rank == 0 else torch.full((3,), 7.0)
    result = strategy.broadcast(tensor, src=0).tolist()
    strategy.teardown()
    return result


def test_mismatched_broadcast_unchecked_is_silent_checked_raises_on_every_rank() -> None:
    # Measured, not promised: unchecked, gloo fills only the common prefix and nobody notices.
    assert run_distributed(_broadcast_mismatch, world_size=2, args=(False,)) == [
        [0.0, 0.0],
        [0.0, 0.0, 7.0],
    ]
    outcomes = run_distributed(_broadcast_mismatch, world_size=2, args=(True,), allow_failure=True)
    for outcome in outcomes:
        assert outcome.error_type == "CollectiveError", outcome.describe()
        assert outcome.error.startswith(
            "broadcast: ranks passed tensors of different shapes or "
            "dtypes (rank 0: (2,) torch.float32, rank 1: (3,) "
            "torch.float32); every rank must pass the same shape"
        )
