"""Tables with raw int64 ids (HashIds, ManagedCollisions), their batches, the single-process
reference and the sharded worker for tests/unit/test_raw_ids_single.py and
tests/dist/test_raw_ids_sharded.py.

The reference looks the ranks' batches up as one global batch (one forward: a managed-collision
remapper sees each training step once, as the sharded one does) and trains the unsharded
collection with torch's own optimizer on the mean of the ranks' losses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from embedding_cases import ReferenceUpdates, local_loss, optimizer

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    HashIds,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)

SEED = 5
STEPS = 3
HASHED_TABLES = (
    EmbeddingBagConfig("h0", 13, 4, raw_ids=HashIds()),
    EmbeddingBagConfig("h1", 7, 3, feature_names=("h1a", "h1b"), raw_ids=HashIds(salt=99)),
    EmbeddingBagConfig("plain", 11, 2, pooling="mean"),
)
# raw ids drawn from this pool (negative, huge and small), so bags repeat ids across ranks
RAW_POOL = torch.tensor(
    [-(2**63), -(2**40) - 3, -7, -1, 0, 1, 2, 5, 10**12 + 9, 2**62 + 11, 2**63 - 1, 31337]
)


def raw_batch(
    rank: int, step: int, batch: int, tables: Sequence[EmbeddingBagConfig]
) -> SparseFeatures:
    """0 to 3 ids per bag: raw ids from RAW_POOL for raw-id tables, rows for the others."""
    generator = torch.Generator().manual_seed(500 * rank + step)
    bags = {}
    for table in tables:
        for feature in table.feature_names:
            lengths = torch.randint(0, 4, (batch,), generator=generator).tolist()
            if table.raw_ids is None:
                draw = [
                    torch.randint(0, table.num_embeddings, (n,), generator=generator)
                    for n in lengths
                ]
            else:
                draw = [
                    RAW_POOL[torch.randint(0, len(RAW_POOL), (n,), generator=generator)]
                    for n in lengths
                ]
            bags[feature] = [ids.tolist() for ids in draw]
    return SparseFeatures.from_dict(bags)


def global_batch(batches: Sequence[SparseFeatures]) -> SparseFeatures:
    """The ranks' batches as one: each feature's bags, rank after rank."""
    keys = batches[0].keys
    return SparseFeatures.from_dict(
        {key: [bag for batch in batches for bag in batch[key].to_lists()] for key in keys}
    )


def reference(
    tables: Sequence[EmbeddingBagConfig], batch_sizes: Sequence[int], opt_name: str = "sgd"
) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Per step, each rank's pooled output; then the tables after STEPS steps."""
    ebc = EmbeddingBagCollection(tables, seed=SEED)
    params = {name: table.weight for name, table in ebc.tables.items()}
    updates = ReferenceUpdates(opt_name, params)
    world = len(batch_sizes)
    outputs = []
    for step in range(STEPS):
        batches = [raw_batch(r, step, b, tables) for r, b in enumerate(batch_sizes)]
        pooled = ebc(global_batch(batches)).values
        per_rank = list(pooled.split(list(batch_sizes)))
        outputs.append([p.detach().clone() for p in per_rank])
        loss = sum(local_loss(p, r, step) for r, p in enumerate(per_rank)) / world
        for p in params.values():
            p.grad = None
        loss.backward()
        updates.step()
    return outputs, {name: p.detach().clone() for name, p in params.items()}


def plan_for(tables: Sequence[EmbeddingBagConfig], world: int) -> EmbeddingPlan:
    """Row-wise raw-id tables (their rows on every rank), the others table-wise on the last."""
    return EmbeddingPlan(
        world,
        {t.name: row_wise() if t.raw_ids is not None else table_wise(world - 1) for t in tables},
    )


def train_sharded(
    tables: Sequence[EmbeddingBagConfig], batch_sizes: Sequence[int], opt_name: str = "sgd"
) -> dict:
    """On each rank: STEPS steps of the sharded collection; outputs per step, full tables."""
    strategy = mp.ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables, seed=SEED)
    emb = shard_embeddings(ebc, strategy, plan_for(tables, world), optimizer(opt_name))
    outputs = []
    for step in range(STEPS):
        pooled = emb(raw_batch(rank, step, batch_sizes[rank], tables)).values
        outputs.append(pooled.detach().clone())
        local_loss(pooled, rank, step).backward()
    with full_tensors():
        weights = {k.split(".")[1]: v for k, v in emb.state_dict().items() if k.endswith("weight")}
    if world > 1:
        strategy.teardown()
    return {"outputs": outputs, "tables": weights}


def check_against_reference(
    per_rank: Sequence[dict], tables: Sequence[EmbeddingBagConfig], batch_sizes: Sequence[int]
) -> None:
    ref_outputs, ref_tables = reference(tables, batch_sizes)
    for rank, got in enumerate(per_rank):
        for step in range(STEPS):
            torch.testing.assert_close(
                got["outputs"][step], ref_outputs[step][rank], msg=f"rank {rank}, step {step}"
            )
        for name, expected in ref_tables.items():
            torch.testing.assert_close(got["tables"][name], expected, msg=f"table {name}")
