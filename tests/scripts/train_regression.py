"""A Trainer run under torchrun; `--kill-at N` SIGKILLs rank 1 at step N on the first attempt.
`--self-launch`: a plain `python` run that starts its own 2 workers (one restart allowed)."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import manualpar as mp


class Regression(mp.ParallelModule):
    def __init__(self, kill_at: int | None) -> None:
        super().__init__()
        self.kill_at = kill_at
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.strategy_ = strategy
        self.net = mp.ddp(self.net, strategy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=0.01)

    def training_step(self, batch: tuple, step: int) -> torch.Tensor:
        env = self.strategy_.environment
        if step == self.kill_at and env.rank == 1 and env.restart_count == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)


def data(step: int, strategy: mp.ManualParallelStrategy) -> tuple:
    generator = torch.Generator().manual_seed(step * 97 + strategy.rank)
    x = torch.randn(8, 6, generator=generator)
    return x, x.sum(-1).sin()


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--self-launch", action="store_true")
    args = parser.parse_args()
    if args.self_launch:
        strategy = mp.ManualParallelStrategy(num_processes=2, max_restarts=1)
    else:
        strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(0)
    model = Regression(args.kill_at)
    trainer = mp.Trainer(
        strategy, args.out, max_steps=args.steps, checkpoint_every=4, log_every=1, progress=False
    )
    trainer.fit(model, data)
    if strategy.is_global_zero:
        torch.save(model.net.module.state_dict(), Path(args.out) / "final.pt")
        restarts = strategy.environment.restart_count
        (Path(args.out) / "restarts.txt").write_text(str(restarts))
    strategy.teardown()


if __name__ == "__main__":
    main()
