"""Two embedding collections in one model, planned together with `plan_collections`.

A user tower holds the first three shared test tables and an item tower the other three; each
rank feeds each tower its own features (`SparseFeatures.select`). Concatenated, the towers'
outputs are exactly the output of one collection of all the tables, so the single-process
reference of embedding_cases applies unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from embedding_cases import SEED, STEPS, TABLES, local_loss, make_batch, optimizer

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import EmbeddingBagCollection, shard_embeddings
from manualpar.embeddings.planning import plan_collections

TOWERS = {"user": TABLES[:3], "item": TABLES[3:]}


def train_two_towers(batch_sizes: list[int], opt_name: str) -> dict[str, Any]:
    """On each rank: plan both towers in one call (the budget agreed over the ranks), shard
    each with its plan, train STEPS steps; return the plans, the first output, full tables and
    optimizer state."""
    strategy = mp.ManualParallelStrategy()
    rank = strategy.rank
    with mp.empty_init():
        towers = {name: EmbeddingBagCollection(t, seed=SEED) for name, t in TOWERS.items()}
    # replicate_bytes=0: these test tables are tiny and would all be replicated
    plans = plan_collections(towers, strategy, replicate_bytes=0)
    sharded = {
        name: shard_embeddings(ebc, strategy, plan=plans[name], rule=optimizer(opt_name))
        for name, ebc in towers.items()
    }
    first = None
    for step in range(STEPS):
        batch = make_batch(rank, step, batch_sizes[rank])
        pooled = torch.cat(
            [
                emb(batch.select([f for t in TOWERS[name] for f in t.feature_names])).values
                for name, emb in sharded.items()
            ],
            1,
        )
        if step == 0:
            first = pooled.detach().clone()
        local_loss(pooled, rank, step).backward()
    tables, state = {}, {}
    with full_tensors():
        for emb in sharded.values():
            tables.update({k.split(".")[1]: v for k, v in emb.state_dict().items()})
            state.update(emb.fused_optimizer.state_dict()["state"])
    strategy.teardown()
    return {
        "plans": {name: plan.to_dict() for name, plan in plans.items()},
        "first": first,
        "tables": tables,
        "state": state,
    }
