"""The small model and its two param groups shared by the zero_optimizer() tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def make_model(seed: int, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        return nn.Sequential(
            nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
        )


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups with their own learning rates: sharded per group by ZeRO."""
    return [
        {"params": list(model[0].parameters()) + list(model[2].parameters())},
        {"params": model[4].parameters(), "lr": 0.03},
    ]
