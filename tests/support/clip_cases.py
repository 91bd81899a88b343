"""clip_grad_norm_ over a model mixed from ddp (plain gradients), fsdp (DTensor shards) and a
replicated DTensor, against torch's clip_grad_norm_ on one process over the global batch."""

from __future__ import annotations

import torch
from fsdp_cases import make_net
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import manualpar as mp
from manualpar import ManualParallelStrategy

GLOBAL_BATCH = 8


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 5, generator=generator), torch.randn(
        GLOBAL_BATCH, 3, generator=generator
    )


def reference(max_norm: float, norm_type: float) -> dict:
    net = make_net(0)
    scale = nn.Parameter(torch.tensor(2.0))
    x, y = batch()
    nn.functional.mse_loss(net(x) * scale, y).backward()
    params = [*net.parameters(), scale]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return {"total": total.item(), "grads": [p.grad.flatten().tolist() for p in params]}


def mixed(max_norm: float, norm_type: float) -> dict:
    strategy = ManualParallelStrategy()
    net = make_net(0)
    net.inp = mp.ddp(net.inp, strategy)  # plain, averaged gradients
    for block in net.blocks:
        mp.fsdp(block, strategy)  # DTensor shards
    mp.fsdp(net.out, strategy)
    mesh = net.blocks[0].fc.weight.device_mesh
    scale = nn.Parameter(distribute_tensor(torch.tensor(2.0), mesh, [Replicate()]))
    x, y = batch()
    local = GLOBAL_BATCH // strategy.world_size
    mine = slice(strategy.rank * local, (strategy.rank + 1) * local)
    out = net(x[mine])
    loss = nn.functional.mse_loss(out * scale.to_local(), y[mine])
    loss.backward()
    # The replicated scalar's gradient, averaged as a replicated parameter would be.
    averaged = strategy.all_reduce(scale.grad.to_local(), op="mean")
    scale.grad = DTensor.from_local(averaged, mesh, [Replicate()])
    params = [*net.parameters(), scale]
    total = mp.clip_grad_norm_(params, max_norm, norm_type)
    grads = [
        (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).flatten().tolist()
        for p in params
    ]
    strategy.teardown()
    return {"total": total.item(), "grads": grads}
