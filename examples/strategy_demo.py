"""A 2-process tour of ManualParallelStrategy: ranks, collectives, checkpoints, resume.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/strategy_demo.py

Runs as a single process too (`python examples/strategy_demo.py`). Each rank trains a copy of a
tiny regression model on its own slice of the data; gradients are averaged with
`strategy.all_reduce` (what DDP does, written out to show the collective). A sharded checkpoint is
saved every few steps; a rerun resumes from the latest one.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import manualpar as mp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo", help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    return parser.parse_args()


def batch_for(step: int, rank: int, size: int, true_weight: torch.Tensor) -> tuple:
    """Deterministic data keyed by (step, rank): a resumed run sees the same batches."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(size, true_weight.numel(), generator=generator)
    return x, x @ true_weight + 0.01 * torch.randn(size, generator=generator)


@record  # a worker's exception reaches torchrun's / torchx's error report
def main() -> None:
    args = parse_args()
    strategy = mp.ManualParallelStrategy()
    say = print if strategy.is_global_zero else (lambda *a, **k: None)
    print(f"[rank {strategy.rank}] {strategy}", flush=True)

    # Collectives: every rank gets the same answers.
    ranks = strategy.all_gather(torch.tensor([strategy.rank]))
    mine: dict[str, Any] | None = {"lr": 0.05, "hidden": 16} if strategy.is_global_zero else None
    config = strategy.broadcast(mine)
    assert config is not None  # rank 0's, on every rank
    total = strategy.all_reduce(torch.tensor(float(strategy.rank + 1)), op="sum")
    say(
        f"all_gather of ranks -> {ranks.flatten().tolist()}; broadcast config -> {config}; "
        f"sum of (rank + 1) -> {total.item():g}"
    )

    strategy.seed_everything(0)
    true_weight = torch.linspace(-1, 1, 8)
    model = nn.Sequential(nn.Linear(8, config["hidden"]), nn.Tanh(), nn.Linear(config["hidden"], 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    state: dict[str, Any] = {"model": model, "optim": optimizer, "step": 0, "rng": mp.RNGState()}

    latest = mp.latest_checkpoint(args.out)
    if latest is not None:
        strategy.load_checkpoint(latest, state)
        say(f"resumed from {latest} at step {state['step']}")

    started = time.perf_counter()
    while state["step"] < args.steps:
        step = state["step"]
        x, y = batch_for(step, strategy.rank, args.batch, true_weight)
        loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
        optimizer.zero_grad()
        loss.backward()
        for param in model.parameters():  # average gradients over ranks, as DDP would
            if param.grad is not None:
                param.grad = strategy.all_reduce(param.grad, op="mean")
        optimizer.step()
        state["step"] = step + 1
        mean_loss = strategy.all_reduce(loss.detach(), op="mean").item()
        if state["step"] % 10 == 0 or state["step"] == args.steps:
            rate = state["step"] / (time.perf_counter() - started)
            say(f"step {state['step']:4d}/{args.steps}  loss {mean_loss:.4f}  ({rate:.0f} steps/s)")
        if state["step"] % args.every == 0 or state["step"] == args.steps:
            path = strategy.save_checkpoint(f"{args.out}/step_{state['step']:06d}", state)
            say(f"saved {path}")

    # Reload the latest checkpoint into a fresh model and check it matches on every rank.
    fresh = nn.Sequential(nn.Linear(8, config["hidden"]), nn.Tanh(), nn.Linear(config["hidden"], 1))
    latest = mp.latest_checkpoint(args.out)
    assert latest is not None  # (saved above)
    strategy.load_checkpoint(latest, {"model": fresh}, strict=False)
    pairs = zip(fresh.parameters(), model.parameters(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    agreed = strategy.all_reduce(torch.tensor(float(same)), op="min").item() == 1.0
    say(f"reloaded {latest} into a fresh model: parameters identical on all ranks: {agreed}")
    strategy.teardown()
    if not agreed:
        raise SystemExit("checkpoint reload mismatch")


if __name__ == "__main__":
    main()
