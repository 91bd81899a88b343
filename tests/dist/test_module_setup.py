"""ParallelModule on real ranks: a forward before setup is refused where it would train one
replica per rank."""

from __future__ import annotations

import torch

from manualpar import ManualParallelStrategy
from manualpar.testing import run_distributed


def _forward_before_setup() -> tuple[str, list[int]]:
    """An eagerly built model whose setup wraps its parts, run before setup on 2 ranks, would
    train one replica per rank: refused. A ParallelModule without its own setup is a plain
    replica by design, so it runs."""
    from torch import nn

    import manualpar as mp

    class Tower(mp.ParallelModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def setup(self, strategy: ManualParallelStrategy) -> None:
            self.fc = mp.ddp(self.fc, strategy)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    class Replica(mp.ParallelModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    strategy = ManualParallelStrategy()
    model = Tower()
    try:
        model(torch.ones(1, 3))
        message = "no error"
    except mp.BuilderError as error:
        message = str(error)
    model.setup(strategy)
    shapes = [list(model(torch.ones(1, 3)).shape), list(Replica()(torch.ones(1, 3)).shape)]
    strategy.teardown()
    return message, [n for shape in shapes for n in shape]


def test_forward_before_setup_in_a_job_of_2_ranks_is_refused() -> None:
    for message, shapes in run_distributed(_forward_before_setup, world_size=2):
        assert message == (
            "Tower.forward() called before setup(strategy) in a job of 2 ranks: its parts are "
            "not wrapped yet, so each rank would train its own replica; call "
            "model.setup(strategy) first"
        )
        assert shapes == [1, 2, 1, 2]
