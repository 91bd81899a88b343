"""Disk-tier jobs run on each rank: a table 8x its cache trained beside the same table in memory
(same batches, same plan shape), checkpoints across world sizes and tiers, a kill mid
write-back. Every job returns full tables and optimizer state for exact comparison."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import torch

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    Adam,
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    UpdateRule,
    row_wise,
    table_wise,
)
from manualpar.embeddings import shard_embeddings as shard
from manualpar.embeddings.storage import disk_tier
from manualpar.embeddings.storage.disk_tier import DiskTable

ROWS = 960
TABLES = (
    EmbeddingBagConfig("big", ROWS, 8),
    EmbeddingBagConfig("side", 12, 4, feature_names=("side", "side_last")),
)
SEED = 5
BAGS = 12  # per rank and feature; up to 3 ids each


def rule(name: str) -> UpdateRule:
    return RowWiseAdagrad(lr=0.2) if name == "rowwise" else Adam(lr=0.05)


def batch(rank: int, step: int, ids: str) -> SparseFeatures:
    """Bags of 1-3 ids; the big table's ids uniform or Zipf-like (a few hot rows)."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(1, 4, (BAGS,), generator=generator)
    count = int(lengths.sum())
    if ids == "zipf":
        ranks = (torch.rand(count, generator=generator) ** 3 * ROWS).long()  # skewed to 0
        big = (ranks * 97) % ROWS  # hot rows scattered over the blocks
    else:
        big = torch.randint(0, ROWS, (count,), generator=generator)
    side = torch.randint(0, 12, (2 * BAGS,), generator=generator)
    return SparseFeatures(
        ["big", "side", "side_last"],
        torch.cat([big, side]),
        torch.cat([lengths, torch.ones(2 * BAGS, dtype=torch.int64)]),
    )


def plan(world: int, disk: bool) -> EmbeddingPlan:
    big = row_wise(on_disk=True) if disk else row_wise()
    return EmbeddingPlan(world, {"big": big, "side": table_wise(world - 1)})


def build(
    strategy: Any, opt: str, tier: DiskTier | None, dtype: torch.dtype = torch.float32
) -> Any:
    tables = [dataclasses.replace(table, dtype=dtype) for table in TABLES]
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables, seed=SEED)
    return shard(
        ebc, strategy, plan(strategy.world_size, tier is not None), rule(opt), disk_tier=tier
    )


def train(emb: Any, rank: int, steps: range, ids: str) -> None:
    for step in steps:
        pooled = emb(batch(rank, step, ids)).values
        coef = torch.randn(pooled.shape, generator=torch.Generator().manual_seed(step + 7 * rank))
        ((pooled * coef).sum(1) - 0.3).square().mean().backward()


def snapshot(emb: Any) -> dict[str, Any]:
    with full_tensors():
        return {
            "tables": {k.split(".")[1]: v.clone() for k, v in emb.state_dict().items()},
            "state": emb.fused_optimizer.state_dict()["state"],
            "step": emb.fused_optimizer.num_updates,
        }


def cache_rows(world: int) -> int:
    """An eighth of the largest block of the big table."""
    return -(-ROWS // world) // 8


def train_pair(
    directory: str,
    opt: str,
    ids: str,
    steps: int,
    dtype: torch.dtype = torch.float32,
    write_log: float = 4.0,
) -> dict[str, Any]:
    """The same steps on the big table in memory and on disk (rows in `dtype`, a write log of
    `write_log` caches); both snapshots, hit counts and the log's counts before the snapshot
    drains it."""
    strategy = mp.ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    memory = build(strategy, opt, None, dtype)
    tier = DiskTier(directory, cache_rows=cache_rows(world), policy="lru", write_log=write_log)
    disk = build(strategy, opt, tier, dtype)
    train(memory, rank, range(steps), ids)
    train(disk, rank, range(steps), ids)
    table = disk.storage.by_name["big"]
    log = table.log
    out = {
        "logged": (log.appended, log.drains, int(table.cache.logged_rows()[0].numel())),
        "memory": snapshot(memory),
        "disk": snapshot(disk),
        "misses": table.cache.misses,
        "capacity": table.cache.capacity,
        "log_rows": table.file.log_rows,
    }
    strategy.teardown()
    return out


def resharded_phase(
    directory: str, opt: str, load: tuple[str, str] | None, steps: range, save: tuple[str, str]
) -> dict[str, Any]:
    """One phase of a 2 -> 1 -> 3 chain: an in-memory and a disk collection, each loading the
    *other* tier's checkpoint of the previous phase (`load`: memory's, disk's), training
    `steps`, saving (`save`)."""
    disk_tier.CHUNK_BYTES = 4096  # checkpoints of a disk table in many chunks (of 42 rows)
    strategy = mp.ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    memory = build(strategy, opt, None)
    disk = build(strategy, opt, DiskTier(Path(directory) / "tier", cache_rows=cache_rows(world)))
    jobs = {"memory": memory, "disk": disk}
    if load is not None:
        sources = {"memory": load[1], "disk": load[0]}  # crossed: disk -> memory, memory -> disk
        for name, emb in jobs.items():
            state = {"model": emb, "sparse_optim": emb.fused_optimizer}
            strategy.load_checkpoint(sources[name], state)
    for emb in jobs.values():
        train(emb, rank, steps, "zipf")
    for name, target in zip(jobs, save, strict=True):
        emb = jobs[name]
        strategy.save_checkpoint(target, {"model": emb, "sparse_optim": emb.fused_optimizer})
    out = {name: snapshot(emb) for name, emb in jobs.items()}
    strategy.teardown()
    return out


def die_in_write_back(directory: str, checkpoint: str) -> dict[str, Any]:
    """Train 2 steps on disk, save (committed), then train on with rank 1 killed (SIGKILL) half
    way through its next write-back of evicted rows."""
    strategy = mp.ManualParallelStrategy()
    rank = strategy.rank
    emb = build(strategy, "adam", DiskTier(directory, cache_rows=cache_rows(2)))
    train(emb, rank, range(2), "uniform")
    strategy.save_checkpoint(checkpoint, {"model": emb, "sparse_optim": emb.fused_optimizer})
    if rank == 1:
        original = DiskTable._write

        def write_half_then_die(
            self: DiskTable, rows: torch.Tensor, records: torch.Tensor, in_place: bool = False
        ) -> None:
            half = max(1, rows.numel() // 2)
            original(self, rows[:half], records[:half], in_place)  # to the write log
            self.write_back.settle()  # half of the batch landed
            os.kill(os.getpid(), signal.SIGKILL)

        DiskTable._write = write_half_then_die  # type: ignore[method-assign]
    train(emb, rank, range(2, 6), "uniform")
    strategy.teardown()
    return {"survived": True}


def load_after_kill(directory: str, checkpoint: str) -> dict[str, Any]:
    """Load the committed checkpoint into the disk tier in the killed job's directory (its
    files are reused), and train the same 2 steps in memory from scratch to compare."""
    strategy = mp.ManualParallelStrategy()
    rank = strategy.rank
    disk = build(strategy, "adam", DiskTier(directory, cache_rows=cache_rows(2)))
    strategy.load_checkpoint(checkpoint, {"model": disk, "sparse_optim": disk.fused_optimizer})
    memory = build(strategy, "adam", None)
    train(memory, rank, range(2), "uniform")
    out = {"disk": snapshot(disk), "memory": snapshot(memory)}
    strategy.teardown()
    return out


def too_small_cache(directory: str) -> str:
    """Every rank's block gets a 4-row cache: the first step needs more."""
    strategy = mp.ManualParallelStrategy()
    emb = build(strategy, "rowwise", DiskTier(directory, cache_rows=4))
    try:
        train(emb, strategy.rank, range(1), "uniform")
    except Exception as error:  # the message is the test's subject
        return f"{type(error).__name__}: {error}"
    finally:
        strategy.teardown()
    return "no error"
