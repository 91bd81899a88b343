"""Differentiable all_gather cases: raw gradients, and two towers with in-batch negatives."""

from __future__ import annotations

import torch
from torch import nn

from manualpar import ManualParallelStrategy, ddp

GLOBAL_BATCH, DIM = 8, 4


def gathered_gradient() -> dict:
    """Rank r's loss weights slice s by (r + 1) * (s + 1): the gradient of each rank's input
    must be the sum over the ranks that used it."""
    strategy = ManualParallelStrategy()
    rank = strategy.rank
    x = torch.full((3,), float(rank), requires_grad=True)
    gathered = strategy.all_gather(x, differentiable=True)
    weights = torch.tensor([(rank + 1.0) * (s + 1) for s in range(strategy.world_size)])
    (gathered.sum(1) * weights).sum().backward()
    out = {"values": gathered.detach().tolist(), "grad": x.grad.tolist()}
    strategy.teardown()
    return out


def towers() -> tuple[nn.Linear, nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    queries, items = nn.Linear(6, DIM), nn.Linear(5, DIM)
    return queries, items, torch.randn(GLOBAL_BATCH, 6), torch.randn(GLOBAL_BATCH, 5)


def softmax_loss(query: torch.Tensor, candidates: torch.Tensor, first: int) -> torch.Tensor:
    """Each query's positive is its own item (at `first` + its row); all others are negatives."""
    labels = torch.arange(first, first + len(query))
    return nn.functional.cross_entropy(query @ candidates.T, labels)


def reference_gradients() -> dict[str, list]:
    """One process over the global batch."""
    queries, items, q_in, i_in = towers()
    softmax_loss(queries(q_in), items(i_in), 0).backward()
    return {name: p.grad.tolist() for name, p in _named(queries, items)}


def distributed_gradients() -> dict[str, list]:
    """Each rank: its local queries against every rank's items (gathered), DDP towers."""
    strategy = ManualParallelStrategy()
    queries, items, q_in, i_in = towers()
    local = GLOBAL_BATCH // strategy.world_size
    mine = slice(strategy.rank * local, (strategy.rank + 1) * local)
    dq, di = ddp(queries, strategy), ddp(items, strategy)
    everyone = strategy.all_gather(di(i_in[mine]), differentiable=True).flatten(0, 1)
    softmax_loss(dq(q_in[mine]), everyone, mine.start).backward()
    out = {name: p.grad.tolist() for name, p in _named(queries, items)}
    strategy.teardown()
    return out


def _named(queries: nn.Module, items: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(f"query.{n}", p) for n, p in queries.named_parameters()] + [
        (f"item.{n}", p) for n, p in items.named_parameters()
    ]
