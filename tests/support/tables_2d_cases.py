"""Rank functions for 2-D (replicate, shard) sharded tables: training against the reference,
bad meshes and plans, and checkpoints across 1-D and 2-D layouts.

Jobs run with 4 ranks on 2 simulated nodes of 2 (mesh replicate=2, shard=2: each node holds a
sharded copy of the tables) unless a checkpoint job says otherwise.
"""

from __future__ import annotations

import re
from typing import Any

import embedding_cases as bags
import sequence_cases as seq
import torch
from embedding_cases import SEED, STEPS, TABLES, local_loss, make_batch, optimizer

import manualpar as mp
from manualpar.checkpoint.local_shards import LocalShards, full_tensors
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    EmbeddingPlan,
    RowWiseAdagrad,
    UpdateRule,
    shard_embeddings,
)
from manualpar.errors import BuilderError, PlanError

BATCHES = [5, 3, 4, 2]  # per rank: uneven, so a wrong weighting of the replicas shows
# (plan kind for the shard dim, optimizer, normalize_by)
TRAINED = (
    ("mixed", "sgd", "world_size"),
    ("row_wise", "rowwise", "world_size"),
    ("column_wise", "adam", "world_size"),
    ("table_wise", "adagrad", "global_samples"),
)


def plan_named(name: str, world: int) -> EmbeddingPlan:
    return bags.mixed_plan(world) if name == "mixed" else bags.uniform_plan(name, world)


def _blocks(emb: Any) -> dict[str, torch.Tensor]:
    """This rank's raw blocks and optimizer state (to compare replicas bit for bit)."""
    out = {f"w/{name}": t.weight.detach().clone() for name, t in emb.tables.items()}
    for name, state in emb.fused_optimizer.table_state.items():
        out.update({f"s/{name}/{k}": v.clone() for k, v in state.items()})
    return out


def _full(emb: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with full_tensors():
        tables = {k.split(".")[1]: v for k, v in emb.state_dict().items()}
        state = emb.fused_optimizer.state_dict()["state"]
    return tables, state


def _train_bags(
    strategy: mp.ManualParallelStrategy,
    plan: EmbeddingPlan | str,
    rule: UpdateRule,
    normalize: str,
    mesh: Any,
    frozen: str | None = None,
) -> dict[str, Any]:
    with mp.empty_init():
        ebc = EmbeddingBagCollection(TABLES, seed=SEED)
    if frozen:
        ebc.tables[frozen].weight.requires_grad_(False)
    emb = shard_embeddings(ebc, strategy, plan, rule, normalize_by=normalize, mesh=mesh)
    rank, first = strategy.rank, None
    for step in range(STEPS):
        pooled = emb(make_batch(rank, step, BATCHES[rank])).values
        first = pooled.detach().clone() if first is None else first
        local_loss(pooled, rank, step).backward()
    tables, state = _full(emb)
    return {
        "first": first,
        "tables": tables,
        "state": state,
        "blocks": _blocks(emb),
        "plan_size": emb.plan.world_size,
    }


def _train_sequence(strategy: mp.ManualParallelStrategy, mesh: Any) -> dict[str, Any]:
    with mp.empty_init():
        ec = EmbeddingCollection(seq.TABLES, seed=SEED)
    world = 2 if mesh is not None else strategy.world_size
    emb = shard_embeddings(ec, strategy, seq.mixed_plan(world), optimizer("rowwise"), mesh=mesh)
    rank = strategy.rank
    for step in range(STEPS):
        out = emb(seq.make_batch(rank, step, BATCHES[rank]))
        seq.local_loss(out, rank, step, BATCHES[rank]).backward()
    tables, state = _full(emb)
    return {"tables": tables, "state": state, "blocks": _blocks(emb)}


def _error(call: Any) -> str:
    try:
        call()
    except (BuilderError, PlanError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def train_2d() -> dict[str, Any]:
    """Every TRAINED case on the 2x2 mesh; global clipping and a frozen table 2-D against 1-D;
    a sequence collection 2-D against 1-D; plan='auto'; the refusals."""
    strategy = mp.ManualParallelStrategy()
    mesh = strategy.mesh(replicate=2, shard=2)
    results: dict[str, Any] = {}
    for kind, opt_name, normalize in TRAINED:
        results[kind] = _train_bags(
            strategy, plan_named(kind, 2), optimizer(opt_name), normalize, mesh
        )
    clipped = RowWiseAdagrad(lr=0.3, max_grad_norm=0.05)
    results["clip_2d"] = _train_bags(
        strategy, plan_named("mixed", 2), clipped, "world_size", mesh, "t2"
    )
    clipped = RowWiseAdagrad(lr=0.3, max_grad_norm=0.05)
    results["clip_1d"] = _train_bags(
        strategy, plan_named("mixed", 4), clipped, "world_size", None, "t2"
    )
    results["seq_2d"] = _train_sequence(strategy, mesh)
    results["seq_1d"] = _train_sequence(strategy, None)
    results["auto"] = _train_bags(strategy, "auto", optimizer("sgd"), "world_size", mesh)
    with mp.empty_init():
        ebc = EmbeddingBagCollection(TABLES, seed=SEED)
    three_d = strategy.mesh(a=1, b=2, c=2)
    sgd = optimizer("sgd")
    results["errors"] = {
        "plan4": _error(
            lambda: shard_embeddings(ebc, strategy, plan_named("mixed", 4), sgd, mesh=mesh)
        ),
        "shard_only": _error(
            lambda: shard_embeddings(ebc, strategy, plan_named("mixed", 2), sgd, mesh=mesh["shard"])
        ),
        "3d": _error(
            lambda: shard_embeddings(ebc, strategy, plan_named("mixed", 2), sgd, mesh=three_d)
        ),
    }
    strategy.teardown()
    return results


# checkpoints ------------------------------------------------------------------------------------
def checkpoint_job(
    layout: str, plan: str, steps: range, load: str | None, save: str | None
) -> dict[str, Any]:
    """Train `steps` under `plan` on a "1d" or "2d" (replicate = world / 2) layout, loading
    and saving around them; full tables and state (Adam: per-element and step counts)."""
    strategy = mp.ManualParallelStrategy()
    world = strategy.world_size
    mesh = strategy.mesh(replicate=world // 2, shard=2) if layout == "2d" else None
    with mp.empty_init():  # a job that loads starts from other values
        ebc = EmbeddingBagCollection(TABLES, seed=SEED + 1 if load else SEED)
    shard_world = 2 if mesh is not None else world
    emb = shard_embeddings(
        ebc, strategy, plan_named(plan, shard_world), optimizer("adam"), mesh=mesh
    )
    state = {"model": emb, "sparse_optim": emb.fused_optimizer}
    if load:
        strategy.load_checkpoint(load, state)
    for step in steps:
        pooled = emb(make_batch(strategy.rank, step, BATCHES[strategy.rank % 4])).values
        local_loss(pooled, strategy.rank, step).backward()
    shards = list(emb.state_dict().items()) + [
        (f"{table}/{key}", value)
        for table, keys in emb.fused_optimizer.state_dict()["state"].items()
        for key, value in keys.items()
    ]
    written = sum(
        len(value.__create_write_items__(key, value))
        for key, value in shards
        if isinstance(value, LocalShards)
    )
    if save:
        strategy.save_checkpoint(save, state)
    tables, optim = _full(emb)
    strategy.teardown()
    return {
        "tables": tables,
        "state": optim,
        "step": emb.fused_optimizer.num_updates,
        "written": written,
    }


def matches(pattern: str, text: str) -> bool:
    return re.search(pattern, text) is not None
