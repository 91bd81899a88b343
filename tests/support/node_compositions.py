"""Compositions over a (node, local) layout for the multi-node test job: HSDP, FSDP x TP, and a
mixed model (2-D tables + HSDP dense part) whose checkpoint other job shapes load.

Each case lays its mesh out from the launcher (replicate/dp = nodes, shard/tp = processes per
node), so the same case runs as 2 x 2, 4 x 1, or one node of 1, 2 or 3 processes. The
single-process references are plain torch, computed by the test (`reference_losses` in
node_cases.py for HSDP and FSDP x TP, `mixed_reference` here).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import embedding_cases as bags
import torch
from embedding_cases import SEED, TABLES, ReferenceUpdates, make_batch, optimizer
from node_cases import case, tiny_model, train_slices
from torch import nn
from torch.distributed.tensor import DTensor

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import EmbeddingBagCollection, shard_embeddings

__all__ = ["MIXED_BATCH", "MIXED_STEPS", "mixed_reference"]

MIXED_STEPS = 3
MIXED_BATCH = 4  # per virtual rank; the saving job has 4 ranks
TOP_LR = 0.05
TOTAL_DIM = sum(t.embedding_dim * len(t.feature_names) for t in TABLES)


def _layout(strategy: mp.ManualParallelStrategy) -> tuple[int, int]:
    """(nodes, processes per node) of this job."""
    return strategy.num_nodes, strategy.environment.local_world_size


def _full(tensor: torch.Tensor) -> list:
    value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return value.detach().cpu().tolist()


@case
def hsdp(strategy: mp.ManualParallelStrategy, args: argparse.Namespace) -> dict[str, Any]:
    """fsdp over (replicate = nodes, shard = processes per node)."""
    nodes, per_node = _layout(strategy)
    mesh = strategy.mesh(replicate=nodes, shard=per_node)
    model = mp.fsdp(tiny_model(), strategy, mesh=mesh)
    losses = train_slices(strategy, model, strategy.rank, strategy.world_size)
    return {"losses": losses, "weights": [_full(p) for p in model.parameters()]}


@case
def fsdp_tp(strategy: mp.ManualParallelStrategy, args: argparse.Namespace) -> dict[str, Any]:
    """tp inside a node (colwise then rowwise Linear), fsdp across nodes; a tp pair shares its
    batch slice."""
    nodes, per_node = _layout(strategy)
    mesh = strategy.mesh(dp=nodes, tp=per_node)
    model = mp.tp(tiny_model(), strategy, mesh=mesh["tp"], plan={"0": "colwise", "2": "rowwise"})
    model = mp.fsdp(model, strategy, mesh=mesh["dp"])
    losses = train_slices(strategy, model, strategy.group_rank(mesh["dp"]), nodes)
    return {"losses": losses, "weights": [_full(p) for p in model.parameters()]}


# ---- a mixed model: 2-D tables and an HSDP top, checkpointed and loaded by other shapes --------


class Mixed(nn.Module):
    """Sharded tables feeding a small MLP; set up over (replicate = nodes, shard = per node)."""

    def __init__(self, table_seed: int = SEED) -> None:
        super().__init__()
        self.tables = EmbeddingBagCollection(TABLES, seed=table_seed)
        torch.manual_seed(3)
        self.top = nn.Sequential(nn.Linear(TOTAL_DIM, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, features: Any) -> torch.Tensor:
        return self.top(self.tables(features).values).squeeze(-1)


def _target(virtual_rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + 10 * virtual_rank + step)
    return torch.randn(MIXED_BATCH, generator=generator)


def _set_up(strategy: mp.ManualParallelStrategy, table_seed: int) -> tuple[Mixed, Any, Any]:
    nodes, per_node = _layout(strategy)
    mesh = strategy.mesh(replicate=nodes, shard=per_node)
    model = Mixed(table_seed)  # small: built whole, then sharded block by block
    model.tables = shard_embeddings(
        model.tables, strategy, bags.mixed_plan(per_node), optimizer("rowwise"), mesh=mesh
    )
    model.top = mp.fsdp(model.top, strategy, mesh=mesh)
    dense = torch.optim.Adam(model.top.parameters(), lr=TOP_LR)
    return model, dense, {"model": model, "dense_optim": dense, **model.tables.checkpoint_entries()}


def _report(model: Mixed, dense: torch.optim.Optimizer) -> dict[str, Any]:
    with full_tensors():
        tables = {k.split(".")[1]: v.tolist() for k, v in model.tables.state_dict().items()}
        table_state = {
            name: {key: value.tolist() for key, value in keys.items()}
            for name, keys in model.tables.fused_optimizer.state_dict()["state"].items()
        }
    params = list(model.top.parameters())
    return {
        "tables": tables,
        "table_state": table_state,
        "top": [_full(p) for p in params],
        "top_state": [
            {k: _full(v) for k, v in dense.state[p].items() if k != "step"} for p in params
        ],
    }


@case
def mixed(strategy: mp.ManualParallelStrategy, args: argparse.Namespace) -> dict[str, Any]:
    """Train the mixed model on 4 ranks, report losses and state, save to DIR/mixed."""
    model, dense, state = _set_up(strategy, SEED)
    losses = []
    for step in range(MIXED_STEPS):
        out = model(make_batch(strategy.rank, step, MIXED_BATCH))
        loss = nn.functional.mse_loss(out, _target(strategy.rank, step))
        dense.zero_grad()
        loss.backward()
        dense.step()
        losses.append(strategy.all_reduce(loss.detach(), op="mean").item())
    strategy.save_checkpoint(Path(args.dir, "mixed"), state)
    return {"losses": losses, **_report(model, dense)}


@case
def load_mixed(strategy: mp.ManualParallelStrategy, args: argparse.Namespace) -> dict[str, Any]:
    """Load DIR/mixed into this job's shape (other initial tables, so nothing is kept by
    chance) and report the state it holds."""
    model, dense, state = _set_up(strategy, SEED + 1)
    strategy.load_checkpoint(Path(args.dir, "mixed"), state)
    return _report(model, dense)


def mixed_reference(ranks: int = 4) -> dict[str, Any]:
    """One process training the unsharded model on every rank's batch: losses and state."""
    model = Mixed(SEED)
    tables = {name: table.weight for name, table in model.tables.tables.items()}
    updates = ReferenceUpdates("rowwise", tables)
    dense = torch.optim.Adam(model.top.parameters(), lr=TOP_LR)
    losses = []
    for step in range(MIXED_STEPS):
        loss = (
            sum(
                nn.functional.mse_loss(model(make_batch(r, step, MIXED_BATCH)), _target(r, step))
                for r in range(ranks)
            )
            / ranks
        )
        for p in tables.values():
            p.grad = None
        dense.zero_grad()
        loss.backward()
        updates.step()
        dense.step()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "tables": {k: v.detach().tolist() for k, v in tables.items()},
        "table_state": {
            k: {n: t.tolist() for n, t in s.items()} for k, s in updates.state().items()
        },
        "top": [p.detach().tolist() for p in model.top.parameters()],
        "top_state": [
            {k: v.tolist() for k, v in dense.state[p].items() if k != "step"}
            for p in model.top.parameters()
        ],
    }
