"""What each rank of a multi-node test job does: the cases of tests/scripts/two_nodes.py.

A case is a module-level function `(strategy, args) -> dict` registered with `@case`. The script
runs the cases named by `--cases a,b` in order on every rank and writes each rank's dict to
OUT/<case>/rank_<r>.json; `reports(out, case)` reads them back in rank order for the test. The
same script runs under any launcher shape (2 nodes x 2 under `run_nodes`, 4 x 1, 3 processes
under `run_torchrun`, one plain process under `run_python`), so a case written by one job can
be checked by another (e.g. a checkpoint saved by 2 x 2 loaded by 1, 2, 3 processes): pass
the shared folder as `--dir`.

Adding a case: write `@case def name(strategy, args): ...; return {...}` here (tiny model, few
steps), its single-process reference next to it, and assert `reports(out, "name")` in
tests/e2e/test_two_nodes.py; put it in an existing launch's `--cases` when it can share one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import manualpar as mp

__all__ = ["CASES", "STEPS", "case", "reference_losses", "reports", "train_slices"]

Case = Callable[[mp.ManualParallelStrategy, argparse.Namespace], dict[str, Any]]
CASES: dict[str, Case] = {}
STEPS = 4
BATCH = 8  # the global batch: every rank takes an equal slice


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


def reports(out: str | Path, name: str) -> list[dict[str, Any]]:
    """Every rank's report of case `name`, in rank order."""
    paths = sorted(Path(out, name).glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(p.read_text()) for p in paths]


# ---- ranks, nodes and the node x local mesh -----------------------------------------------------


@case
def ranks(strategy: mp.ManualParallelStrategy, args: argparse.Namespace) -> dict[str, Any]:
    """What the strategy reads from the launcher, and a (node, local) mesh with a collective
    over each of its dims."""
    env = strategy.environment
    mesh = strategy.mesh(node=strategy.num_nodes, local=env.local_world_size)
    me = torch.tensor([strategy.rank])
    return {
        "rank": strategy.rank,
        "world_size": strategy.world_size,
        "node_rank": strategy.node_rank,
        "local_rank": strategy.local_rank,
        "num_nodes": strategy.num_nodes,
        "local_world_size": env.local_world_size,
        "source": env.source,
        "agent_pid": os.getppid(),  # which agent (node) started this rank
        "mesh": mesh.mesh.tolist(),
        "mesh_dims": list(mesh.mesh_dim_names or ()),
        "local_members": strategy.all_gather(me, group=mesh["local"]).flatten().tolist(),
        "node_members": strategy.all_gather(me, group=mesh["node"]).flatten().tolist(),
        "local_sum": strategy.all_reduce(float(strategy.rank), "sum", group=mesh["local"]).item(),
        "node_sum": strategy.all_reduce(float(strategy.rank), "sum", group=mesh["node"]).item(),
    }


# ---- data-parallel training against a single-process reference ---------------------------------


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 5, generator=generator)
    return x, x.sum(-1, keepdim=True).sin()


def reference_losses(steps: int = STEPS) -> list[float]:
    """The same training on one process with the whole batch: plain torch."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = batch_at(step)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_slices(
    strategy: mp.ManualParallelStrategy, model: nn.Module, dp_rank: int, dp_size: int
) -> list[float]:
    """STEPS of SGD on data-parallel rank `dp_rank`'s slice of each global batch (of
    `dp_size`); the loss averaged over every rank, per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    share = BATCH // dp_size
    mine = slice(dp_rank * share, (dp_rank + 1) * share)
    losses = []
    for step in range(STEPS):
        x, y = batch_at(step)
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(strategy.all_reduce(loss.detach(), op="mean").item())
    return losses


@case
def ddp(strategy: mp.ManualParallelStrategy, args: argparse.Namespace) -> dict[str, Any]:
    """DDP over every rank of every node; each rank trains on its slice of the global batch."""
    model = mp.ddp(tiny_model(), strategy)
    return {"losses": train_slices(strategy, model, strategy.rank, strategy.world_size)}


# ---- a node lost mid-training -----------------------------------------------------------------


@case
def lose_node(strategy: mp.ManualParallelStrategy, args: argparse.Namespace) -> dict[str, Any]:
    """Train with gradients averaged by the strategy until a node is killed (at most 90 s).

    Each rank marks OUT/lose_node/training_<rank> once training runs; a rank whose collective
    fails writes OUT/lose_node/error_<rank>.json (message and wall-clock time) and re-raises."""
    folder = Path(args.out, "lose_node")
    folder.mkdir(parents=True, exist_ok=True)
    # The node's agent stops every worker (SIGTERM) once the first one exits. A survivor blocked
    # on that first one fails only when it exits, and then needs its 3 s roll call to name the
    # lost ranks: ignore SIGTERM so that it can write its report and exit by itself (the agent
    # still kills it 30 s later if it does not; the test's bound is shorter).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    deadline = time.monotonic() + 90
    step = 0
    try:
        while time.monotonic() < deadline:
            x, y = batch_at(step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            strategy.all_reduce_(grads, op="mean", name="gradient all_reduce")
            optimizer.step()
            step += 1
            if step == 2:
                (folder / f"training_{strategy.rank}").touch()
            time.sleep(0.02)
    except mp.CollectiveError as error:
        report = {"error": str(error), "time": time.time(), "step": step}
        (folder / f"error_{strategy.rank}.json").write_text(json.dumps(report))
        raise
    return {"steps": step}  # no node was lost: the test fails on this
