"""Variable batches per feature (deduplicated bags) against the batch they stand for.

A variable batch is built from a random one (embedding_cases.make_batch): some features keep
one bag per sample (their inverse is the identity), some are deduplicated (a user feature: a
bag per group of samples, read by each of them, the groups in shuffled order), one holds more
bags than samples (bags no sample reads: looked up, never updated). Its `expand()` is the
plain batch it stands for. The same sharded model trains on each, in the same process; and a
float64 unsharded collection trains on the expanded batches as the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from embedding_cases import (
    SEED,
    STEPS,
    TABLES,
    ReferenceUpdates,
    local_loss,
    make_batch,
    optimizer,
)

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingPlan,
    SparseFeatures,
    shard_embeddings,
)

DEDUPLICATED = ("t0", "f1a", "t3", "f5b")  # one of each placement in mixed_plan, mean pooled too
EXTRA_BAGS = "t4"  # two bags more than samples


def variable_batch(rank: int, step: int, batch: int, weighted: bool = False) -> SparseFeatures:
    """A batch per feature: DEDUPLICATED features hold a bag per group of up to 3 samples (the
    bag each sample reads shuffled), EXTRA_BAGS two unread bags more, the rest one per sample."""
    plain = make_batch(rank, step, batch + 2, weighted)  # bags to draw the features' from
    generator = torch.Generator().manual_seed(500 + 10 * rank + step)
    bags: dict[str, list[list[int]]] = {}
    weights: dict[str, list[list[float]]] = {}
    inverse: dict[str, list[int]] = {}
    for key in plain.keys:
        feature = plain[key]
        ids = feature.to_lists()
        per_id = (
            None if feature.weights is None else feature.weights.split(feature.lengths.tolist())
        )
        if key in DEDUPLICATED:
            count = max(1, -(-batch // 3))
            order = torch.randperm(batch, generator=generator)
            inverse[key] = (order % count).tolist()
        elif key == EXTRA_BAGS:
            count = batch + 2
            inverse[key] = torch.randperm(count, generator=generator)[:batch].tolist()
        else:
            count = batch
        bags[key] = ids[:count]
        if per_id is not None:
            weights[key] = [w.tolist() for w in per_id[:count]]
    return SparseFeatures.from_dict(bags, weights if weighted else None, inverse)


def train(
    emb: Any, batches: list[SparseFeatures], strategy: Any, pipelined: bool = False
) -> dict[str, Any]:
    """STEPS steps of `emb` on `batches` (through TrainPipeline if `pipelined`: each next
    batch's input dist runs ahead): the step-0 output, then the full tables and state."""
    loop = mp.TrainPipeline(iter(batches), strategy, emb.prefetch) if pipelined else batches
    first = None
    for step, features in enumerate(loop):
        pooled = emb(features).values
        first = pooled.detach().clone() if first is None else first
        local_loss(pooled, strategy.rank, step).backward()
    with full_tensors():
        tables = {k.split(".")[1]: v for k, v in emb.state_dict().items()}
        state = emb.fused_optimizer.state_dict()["state"]
    return {"first": first, "tables": tables, "state": state}


def train_sharded(
    plans: Sequence[EmbeddingPlan],
    opt_name: str,
    batches: Sequence[int],
    weighted: bool = False,
    pipelined: bool = False,
    mesh: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """On each rank, per plan: a sharded model on the variable batches (`pipelined`: through
    TrainPipeline) and its twin on their expansions; `mesh`: 2-D tables on strategy.mesh(**)."""
    strategy = mp.ManualParallelStrategy()
    rank = strategy.rank
    variable = [variable_batch(rank, step, batches[rank], weighted) for step in range(STEPS)]
    results = []
    for plan in plans:
        twins = []
        for _ in range(2):
            with mp.empty_init():
                ebc = EmbeddingBagCollection(TABLES, seed=SEED)
            layout = None if mesh is None else strategy.mesh(**mesh)
            twins.append(shard_embeddings(ebc, strategy, plan, optimizer(opt_name), mesh=layout))
        results.append(
            {
                "variable": train(twins[0], variable, strategy, pipelined),
                "expanded": train(twins[1], [f.expand() for f in variable], strategy),
            }
        )
    strategy.teardown()
    return results


def float64_reference(
    opt_name: str, batches: Sequence[int], weighted: bool = False
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The unsharded collection in float64 on the expanded batches: step-0 outputs per rank,
    tables after STEPS steps."""
    ebc = EmbeddingBagCollection(TABLES, seed=SEED).double()
    params = {name: table.weight for name, table in ebc.tables.items()}
    updates = ReferenceUpdates(opt_name, params)
    updates.row_state = {n: torch.zeros(p.shape[0], dtype=p.dtype) for n, p in params.items()}
    first = []
    for step in range(STEPS):
        loss = torch.zeros((), dtype=torch.float64)
        for rank, batch in enumerate(batches):
            pooled = ebc(as_float64(variable_batch(rank, step, batch, weighted).expand())).values
            if step == 0:
                first.append(pooled.detach().clone())
            loss = loss + local_loss(pooled, rank, step) / len(batches)
        for p in params.values():
            p.grad = None
        loss.backward()
        updates.step()
    return first, {name: p.detach().clone() for name, p in params.items()}


def as_float64(features: SparseFeatures) -> SparseFeatures:
    """The batch with float64 per-id weights (the float64 collection takes them so)."""
    if features.weights is None:
        return features
    return SparseFeatures(
        features.keys, features.values, features.lengths, features.weights.double()
    )
