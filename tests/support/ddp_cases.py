"""The small network, batches and single-process references shared by the ddp() tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

ATOL = 1e-5


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randn(n, 2, generator=generator)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {name: p.grad.clone() for name, p in inner.named_parameters()}


def full_batch_grads(n: int, seed: int) -> dict[str, torch.Tensor]:
    model = make_net(0)
    mse(model, *batch(n, seed)).backward()
    return grads(model)


def assert_close(actual: dict, expected: dict, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol)


def train(model: nn.Module, optimizer_name: str, steps: int, rank: int, world: int) -> list:
    """Each rank trains on its 1/world share of every global batch of 8; returns the losses."""
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if optimizer_name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    share = slice(8 // world * rank, 8 // world * (rank + 1))
    losses = []
    for step in range(steps):
        x, y = batch(8, seed=step)
        optimizer.zero_grad()
        loss = mse(model, x[share], y[share])
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return [losses, optimizer]
