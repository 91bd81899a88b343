"""Train a model with a DDP part and an FSDP part, then end WITHOUT strategy.teardown().

Launched under torchrun by tests/e2e/test_exit_without_teardown.py. A script that forgets
teardown(), or raises, must still exit cleanly: manualpar destroys the group at interpreter exit,
before finalization, so no gloo thread is left needing the GIL while the interpreter shuts down
(which ended in "terminate called without an active exception" and SIGABRT).

    --parts both|ddp|fsdp   which builders wrap the model's two parts
    --raise-after           raise after training instead of ending normally
"""

from __future__ import annotations

import argparse
import atexit

import torch
import torch.distributed as dist
from torch import nn

import manualpar as mp


def _report_at_exit() -> None:
    # Registered before the strategy exists, so it runs after manualpar's own exit handler.
    print(f"at exit: process group destroyed={not dist.is_initialized()}", flush=True)


class TwoParts(mp.ParallelModule):
    def __init__(self, parts: str) -> None:
        super().__init__()
        self.parts = parts
        self.bottom = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        if self.parts in ("both", "ddp"):
            self.bottom = mp.ddp(self.bottom, strategy)
        if self.parts in ("both", "fsdp"):
            self.top = mp.fsdp(self.top, strategy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.top(self.bottom(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", choices=["both", "ddp", "fsdp"], default="both")
    parser.add_argument("--raise-after", action="store_true")
    args = parser.parse_args()
    atexit.register(_report_at_exit)
    strategy = mp.ManualParallelStrategy()
    torch.manual_seed(0)
    model = TwoParts(args.parts)
    model.setup(strategy)
    optimizer = torch.optim.SGD(model.dense_parameters(), lr=0.01)
    torch.manual_seed(strategy.rank)
    loss = torch.zeros(())
    for _ in range(5):
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    mean_loss = strategy.all_reduce(loss.detach()).item()  # a collective right before exit
    if args.raise_after:
        raise RuntimeError(f"injected failure after training on rank {strategy.rank}")
    print(f"rank {strategy.rank} trained: loss {mean_loss:.4f}", flush=True)
    # no strategy.teardown(): the point of this script


if __name__ == "__main__":
    main()
