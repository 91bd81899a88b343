"""One model, three builders: a DDP embedding and head around FSDP-sharded blocks.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/mixed_ddp_fsdp.py

The model is declared on the meta device (nothing allocated), then `setup(strategy)` shards the
blocks with fsdp() (each rank materializes only its shard), materializes the rest, and wraps the
embedding and the head with ddp(). One plain torch optimizer trains everything. The script saves
a sharded checkpoint, then reloads it into an unsharded copy of the model on rank 0 alone to show
that checkpoints reshard to another world size.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import manualpar as mp
from manualpar.wrappers.ddp import ddp
from manualpar.wrappers.fsdp import fsdp


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class MixedModel(mp.ParallelModule):
    def __init__(self, vocab: int = 64, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, vocab)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.blocks = fsdp(self.blocks, strategy, wrap=(Block,))  # sharded, from meta
        mp.materialize(self, strategy)                             # embed + head (blocks done)
        self.embed = ddp(self.embed, strategy)
        self.head = ddp(self.head, strategy)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def batch(step: int, rank: int, size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learn to predict (token + 1) % vocab: loss falls quickly when the model trains."""
    generator = torch.Generator().manual_seed(step * 100 + rank)
    tokens = torch.randint(0, vocab, (size, 8), generator=generator)
    return tokens, (tokens + 1) % vocab


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/mixed")
    args = parser.parse_args()
    strategy = mp.ManualParallelStrategy()
    say = print if strategy.is_global_zero else (lambda *a, **k: None)
    strategy.seed_everything(0)
    with mp.empty_init():
        model = MixedModel()
    model.setup(strategy)
    optimizer = torch.optim.Adam(model.dense_parameters(), lr=3e-3)   # after setup, never before
    say(f"embed: {type(model.embed).__name__}, blocks: {type(model.blocks).__name__}, "
        f"head: {type(model.head).__name__}; owners: "
        f"{ {k: len(v) for k, v in model.parameters_by_owner().items()} }")
    for step in range(args.steps):
        tokens, targets = batch(step, strategy.rank, 32, 64)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            say(f"step {step:3d}  loss {strategy.all_reduce(loss.detach()).item():.3f}")
    path = strategy.save_checkpoint(f"{args.out}/step_{args.steps}",
                                    {"model": model, "optim": optimizer, "step": args.steps})
    say(f"saved {path}")
    strategy.teardown()
    if strategy.is_global_zero:  # reshard 2 -> 1: a plain, unsharded model on one process
        single = mp.ManualParallelStrategy(mp.ClusterEnvironment())
        plain = MixedModel()
        single.load_checkpoint(path, {"model": plain})
        tokens, targets = batch(10_000, 0, 64, 64)
        with torch.no_grad():
            accuracy = (plain(tokens).argmax(-1) == targets).float().mean().item()
        print(f"reloaded on 1 process without FSDP/DDP: next-token accuracy {accuracy:.2f}")


if __name__ == "__main__":
    main()
