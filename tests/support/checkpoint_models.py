"""Small models and training steps shared by the checkpoint tests (importable by children)."""

from __future__ import annotations

import random

import torch
from torch import nn


def make_model(seed: int, hidden: int = 8, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    blocks: list[nn.Module] = [nn.Linear(4, hidden)]
    for _ in range(layers - 2):
        blocks += [nn.ReLU(), nn.Linear(hidden, hidden)]
    blocks += [nn.ReLU(), nn.Linear(hidden, 2)]
    return nn.Sequential(*blocks)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Same data on every rank, so plain (replicated) modules stay identical across ranks."""
    generator = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.state_dict()["state"]
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "exp_avg": [state[i]["exp_avg"].clone() for i in sorted(state)],
        "exp_avg_sq": [state[i]["exp_avg_sq"].clone() for i in sorted(state)],
        "steps": [float(state[i]["step"]) for i in sorted(state)],
    }


def draws() -> tuple[list[float], float]:
    """The next random numbers of this process (torch and python)."""
    return torch.rand(3).tolist(), random.random()


def assert_same(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for key in a["params"]:
        torch.testing.assert_close(a["params"][key], b["params"][key], rtol=0, atol=0)
    for name in ("exp_avg", "exp_avg_sq"):
        for x, y in zip(a[name], b[name], strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert a["steps"] == b["steps"]
