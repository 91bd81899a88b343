"""Rank functions for the dense builders over device meshes (HSDP, FSDP x TP, ddp and zero over
one dim), and the single-process torch references they are checked against."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import manualpar as mp
from manualpar.errors import BuilderError

IN, HIDDEN, OUT = 6, 8, 3
BATCH, STEPS, LR, MAX_NORM = 8, 3, 0.01, 0.5
TP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}


class MLP(nn.Module):
    """Two layers: fc1 colwise and fc2 rowwise under tensor parallel; an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, IN)
        self.head = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))) + x)


def make_mlp(seed: int = 0, device: str = "cpu") -> MLP:
    torch.manual_seed(seed)
    with torch.device(device):
        return MLP()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator))
        for _ in range(STEPS)
    ]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def reference(clip: bool) -> dict[str, Any]:
    """Plain torch, one process, the global batch: losses and final weights."""
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in batches():
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _train(
    strategy: mp.ManualParallelStrategy, model: nn.Module, rows: slice, clip: bool
) -> dict[str, Any]:
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in batches():
        loss = loss_fn(model(x[rows]), y[rows])
        loss.backward()
        if clip:
            norms.append(float(mp.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(strategy.all_reduce(loss.detach(), "mean")))
    return {"losses": losses, "norms": norms, "state": _full(model)}


# ---- HSDP, and ddp / zero over one dim ---------------------------------------------------------
def hsdp_ddp_zero() -> dict[str, Any]:
    """HSDP from meta (initial weights and training), then ddp and zero over mesh['replicate']."""
    with mp.ManualParallelStrategy() as strategy:
        mesh = strategy.mesh(replicate=2, shard=2)
        torch.manual_seed(0)
        with mp.empty_init():
            model = MLP()
        mp.fsdp(model, strategy, mesh=mesh, wrap=[model.fc1])
        placements = {str(p.placements) for p in model.parameters()}  # type: ignore[attr-defined]
        initial = _full(model)
        per_rank = BATCH // strategy.world_size
        trained = _train(
            strategy, model, slice(strategy.rank * per_rank, (1 + strategy.rank) * per_rank), False
        )
        return {
            "placements": placements,
            "initial": initial,
            **trained,
            **_ddp_zero_over_replicate(strategy, mesh),
        }


def ddp_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's batch: r + 1 samples (uneven, so sample weighting differs from rank weighting)."""
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(rank + 1, IN, generator=generator), torch.randn(
        rank + 1, OUT, generator=generator
    )


def _ddp_zero_over_replicate(strategy: mp.ManualParallelStrategy, mesh: Any) -> dict[str, Any]:
    over = mesh["replicate"]
    by_rank = mp.ddp(make_mlp(3).head, strategy, mesh=over)
    by_samples = mp.ddp(make_mlp(3).head, strategy, mesh=over, normalize_by="global_samples")
    optimizer = mp.zero_optimizer(
        by_rank.parameters(), torch.optim.Adam, strategy, mesh=over, lr=LR
    )
    x, y = ddp_inputs(strategy.rank)
    for part in (by_rank, by_samples):
        loss_fn(part(x), y).backward()
    grads = {
        "rank_mean": [p.grad.clone() for p in by_rank.parameters()],
        "sample_mean": [p.grad.clone() for p in by_samples.parameters()],
    }
    optimizer.step()
    return {
        **grads,
        "zero_group_size": optimizer.process_group.size(),  # type: ignore[attr-defined]
        "zero_stepped": [p.detach().clone() for p in by_rank.parameters()],
    }


def ddp_reference(ranks: list[int]) -> dict[str, Any]:
    """Per-rank plain gradients of the head, averaged by rank and by sample over `ranks`, and
    one Adam step on the rank mean."""
    per_rank, counts = [], []
    for rank in ranks:
        head = make_mlp(3).head
        x, y = ddp_inputs(rank)
        loss_fn(head(x), y).backward()
        per_rank.append([p.grad.clone() for p in head.parameters()])
        counts.append(x.shape[0])
    rank_mean = [torch.stack(g).mean(0) for g in zip(*per_rank, strict=True)]
    total = sum(counts)
    sample_mean = [
        sum(n * g for n, g in zip(counts, grads, strict=True)) / total
        for grads in zip(*per_rank, strict=True)
    ]
    head = make_mlp(3).head
    for p, g in zip(head.parameters(), rank_mean, strict=True):
        p.grad = g.clone()
    optimizer = torch.optim.Adam(head.parameters(), lr=LR)
    optimizer.step()
    return {
        "rank_mean": rank_mean,
        "sample_mean": sample_mean,
        "zero_stepped": [p.detach().clone() for p in head.parameters()],
    }


# ---- FSDP x TP -------------------------------------------------------------------------------
def fsdp_tp() -> dict[str, Any]:
    """tp over mesh['tp'] then fsdp over mesh['dp'], from meta; tp alone from meta; the errors
    of builders over tp's parameters on other meshes."""
    with mp.ManualParallelStrategy() as strategy:
        mesh = strategy.mesh(dp=2, tp=2)
        torch.manual_seed(0)
        with mp.empty_init():
            model = MLP()
        errors = {}
        mp.tp(model, strategy, mesh=mesh["tp"], plan=TP_PLAN)
        try:
            mp.fsdp(model, strategy, mesh=mesh["tp"])
        except BuilderError as error:
            errors["fsdp_same_dim"] = str(error)
        try:
            mp.ddp(model, strategy)
        except BuilderError as error:
            errors["ddp"] = str(error)
        mp.fsdp(model, strategy, mesh=mesh["dp"])
        placements = {
            n: str(p.placements)
            for n, p in model.named_parameters()  # type: ignore[attr-defined]
        }
        initial = _full(model)
        dp = strategy.group_rank(mesh["dp"])
        per_dp = BATCH // 2
        trained = _train(strategy, model, slice(dp * per_dp, (dp + 1) * per_dp), True)
        torch.manual_seed(0)
        with mp.empty_init():
            alone = MLP()
        mp.tp(alone, strategy, mesh=mesh["tp"], plan=TP_PLAN)
        eager = mp.tp(make_mlp(), strategy, mesh=mesh["tp"], plan=TP_PLAN)  # tp rank 0's values
        return {
            "tp_eager": _full(eager),
            "placements": placements,
            "initial": initial,
            "errors": errors,
            "tp_alone": _full(alone),
            "tp_alone_local": tuple(alone.fc1.weight.to_local().shape),  # type: ignore[operator]
            **trained,
        }
