"""The small network shared by the fsdp() tests: two residual blocks between two linears."""

from __future__ import annotations

import torch
from torch import nn

DIM = 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    """Block has 54 parameters, fc 42, inp 36, out 21 (3 rows: an uneven shard on 2 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_net(seed: int, device: str = "cpu") -> Net:
    torch.manual_seed(seed)  # init order is registration order: same values on meta or eager
    with torch.device(device):
        return Net()
