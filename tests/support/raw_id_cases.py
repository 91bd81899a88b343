"""Tables with raw int64 ids (HashIds, ManagedCollisions), their batches, the single-process
reference and the sharded worker for tests/unit/test_emb_ids_raw_ids.py and
tests/dist/test_emb_ids_raw_ids_ranks.py.

The reference looks the ranks' batches up as one global batch (one forward: a managed-collision
remapper sees each training step once, as the sharded one does) and trains the unsharded
collection with torch's own optimizer on the mean of the ranks' losses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from embedding_cases import ReferenceUpdates, local_loss, optimizer

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    HashIds,
    ManagedCollisions,
    SparseFeatures,
    TablePlacement,
    data_parallel,
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
# 12 raw ids for 12 and 10 rows: with 2 to 3 bags per feature and rank, buckets fill up, ids
# collide and rows are evicted
MANAGED_TABLES = (  # managed tables after another: their features are not the first ones
    HASHED_TABLES[1],
    EmbeddingBagConfig("m0", 12, 4, raw_ids=ManagedCollisions(bucket_rows=4)),
    EmbeddingBagConfig(
        "m1",
        10,
        3,
        feature_names=("m1a", "m1b"),
        raw_ids=ManagedCollisions(policy="lfu", salt=3, bucket_rows=3),
    ),
    # 2 buckets: on 3 ranks, rank 0 remaps none of them
    EmbeddingBagConfig("m2", 4, 2, raw_ids=ManagedCollisions(policy="lfu", bucket_rows=2)),
    HASHED_TABLES[2],
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
    tables: Sequence[EmbeddingBagConfig],
    batch_sizes: Sequence[Sequence[int]],
    opt_name: str = "sgd",
) -> dict:
    """One step per entry of `batch_sizes` (the ranks' batch sizes at that step): each rank's
    pooled output per step; then the tables, the remapper's state and its stats."""
    ebc = EmbeddingBagCollection(tables, seed=SEED)
    params = {name: table.weight for name, table in ebc.tables.items()}
    updates = ReferenceUpdates(opt_name, params)
    outputs = []
    for step, sizes in enumerate(batch_sizes):
        batches = [raw_batch(r, step, b, tables) for r, b in enumerate(sizes)]
        pooled = ebc(global_batch(batches)).values
        per_rank = list(pooled.split(list(sizes)))
        outputs.append([p.detach().clone() for p in per_rank])
        loss = sum(local_loss(p, r, step) for r, p in enumerate(per_rank)) / len(sizes)
        for p in params.values():
            p.grad = None
        loss.backward()
        updates.step()
    return {
        "outputs": outputs,
        "tables": {name: p.detach().clone() for name, p in params.items()},
        "remap": remap_state(ebc.state_dict()),
        "stats": ebc.raw_id_remap.raw_id_stats() if ebc.raw_id_remap is not None else {},
    }


def remap_state(state_dict: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state_dict.items() if k.startswith("raw_id_remap.")}


# Where the managed tables go: "exchange" (replicated: every one through the remap exchange),
# "row_wise" (split by rows in whole buckets, each block remapped by its owner in the step),
# "mixed" (m0 whole on one rank and m1 row-wise, both remapped in the step; m2 replicated,
# exchanged) or "at_owner" (every managed table whole on one rank). The reference is the same.
PLACEMENTS = ("exchange", "row_wise", "mixed", "at_owner")
EXCHANGED = {"exchange": ["m0", "m1", "m2"], "row_wise": [], "mixed": ["m2"], "at_owner": []}


def plan_for(
    tables: Sequence[EmbeddingBagConfig], world: int, placement: str = "row_wise"
) -> EmbeddingPlan:
    """Raw-id tables placed as `placement` says (hashed ones row-wise), the others table-wise
    on the last rank."""
    whole = {"m0": 0, "m1": world // 2, "m2": world - 1}  # each table's rank when whole
    by_placement = {
        "exchange": {"m0": "replicated", "m1": "replicated", "m2": "replicated"},
        "row_wise": {},
        "mixed": {"m0": "whole", "m2": "replicated"},
        "at_owner": {"m0": "whole", "m1": "whole", "m2": "whole"},
    }[placement]

    def place(table: EmbeddingBagConfig) -> TablePlacement:
        if table.raw_ids is None:
            return table_wise(world - 1)
        kind = by_placement.get(table.name, "rows")
        if kind == "whole":
            return table_wise(whole[table.name])
        return data_parallel() if kind == "replicated" else row_wise()

    return EmbeddingPlan(world, {t.name: place(t) for t in tables})


def sharded(
    tables: Sequence[EmbeddingBagConfig],
    strategy: mp.ManualParallelStrategy,
    seed: int = SEED,
    replicas: int = 1,
    placement: str = "row_wise",
) -> torch.nn.Module:
    """The sharded collection; with `replicas` > 1 on a 2-D (replicate, shard) mesh."""
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables, seed=seed)
    shards = strategy.world_size // replicas
    mesh = strategy.mesh(replicate=replicas, shard=shards) if replicas > 1 else None
    plan = plan_for(tables, shards, placement)
    return shard_embeddings(ebc, strategy, plan, optimizer("sgd"), mesh=mesh)


def train_steps(emb: torch.nn.Module, steps: range, batch_sizes: Sequence[int]) -> list:
    rank, outputs = emb.strategy.rank, []
    for step in steps:
        pooled = emb(raw_batch(rank, step, batch_sizes[rank], emb.configs)).values
        outputs.append(pooled.detach().clone())
        local_loss(pooled, rank, step).backward()
    return outputs


def full_state(emb: torch.nn.Module) -> dict:
    """Full tables, remapper state and this rank's stats (a collective per tensor)."""
    with full_tensors():
        state = emb.state_dict()
    weights = {k.split(".")[1]: v for k, v in state.items() if k.endswith("weight")}
    stats = emb.raw_id_remap.raw_id_stats() if emb.raw_id_remap is not None else {}
    return {"tables": weights, "remap": remap_state(state), "stats": stats}


def train_sharded(
    tables: Sequence[EmbeddingBagConfig],
    batch_sizes: Sequence[int],
    replicas: int = 1,
    placement: str = "row_wise",
) -> dict:
    """On each rank: STEPS steps of the sharded collection; outputs per step, full state."""
    strategy = mp.ManualParallelStrategy()
    emb = sharded(tables, strategy, replicas=replicas, placement=placement)
    outputs = train_steps(emb, range(STEPS), batch_sizes)
    remap = emb.raw_id_remap
    exchanged = [c.name for c in remap.exchanged] if remap is not None else []
    held = 0  # bytes of remapper state this rank holds (its buckets of every managed table)
    for table in remap.tables.values() if remap is not None else ():
        state = (table.ids, table.last_seen, table.counts)
        held += sum(t.numel() * t.element_size() for t in state)
    result = {"outputs": outputs, **full_state(emb), "exchanged": exchanged, "held": held}
    if strategy.world_size > 1:
        strategy.teardown()
    return result


def summed_stats(per_rank: Sequence[dict]) -> dict:
    tables = per_rank[0]["stats"]
    return {
        name: {key: sum(r["stats"][name][key] for r in per_rank) for key in counts}
        for name, counts in tables.items()
    }


def check_against_reference(
    per_rank: Sequence[dict], tables: Sequence[EmbeddingBagConfig], batch_sizes: Sequence[int]
) -> None:
    ref = reference(tables, [batch_sizes] * STEPS)
    for rank, got in enumerate(per_rank):
        for step in range(STEPS):
            torch.testing.assert_close(
                got["outputs"][step], ref["outputs"][step][rank], msg=f"rank {rank}, step {step}"
            )
        check_state(got, ref, f"rank {rank}")
    assert summed_stats(per_rank) == ref["stats"]


def check_state(got: dict, expected: dict, what: str) -> None:
    for name, tensor in expected["tables"].items():
        torch.testing.assert_close(got["tables"][name], tensor, msg=f"{what}: table {name}")
    assert got["remap"].keys() == expected["remap"].keys(), what
    for key, tensor in expected["remap"].items():
        assert torch.equal(got["remap"][key], tensor), f"{what}: {key}"


def checkpoint_job(
    load: str | None,
    save: str | None,
    steps: range,
    batch_sizes: Sequence[int],
    placement: str = "row_wise",
) -> dict:
    """Load (if given), train `steps`, save (if given); the full state after loading and at
    the end. A loading job starts from other table values: loading must replace them."""
    strategy = mp.ManualParallelStrategy()
    emb = sharded(MANAGED_TABLES, strategy, seed=SEED + 1 if load else SEED, placement=placement)
    state = {"model": emb}
    if load:
        strategy.load_checkpoint(load, state)
    loaded = full_state(emb)
    train_steps(emb, steps, batch_sizes)
    if save:
        strategy.save_checkpoint(save, state)
    result = {"loaded": loaded, "end": full_state(emb)}
    if strategy.world_size > 1:
        strategy.teardown()
    return result


def refusal_job(placement: str = "row_wise") -> str:
    """Rank 1's batch has a row out of range in the plain table: the error each rank raises."""
    strategy = mp.ManualParallelStrategy()
    emb = sharded(MANAGED_TABLES, strategy, placement=placement)
    batch = raw_batch(strategy.rank, 0, 3, MANAGED_TABLES)
    if strategy.rank == 1:
        bags = {key: batch[key].to_lists() for key in batch.keys}
        batch = SparseFeatures.from_dict({**bags, "plain": [[11], [], []]})
    try:
        emb(batch)
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    else:
        message = "no error"
    strategy.teardown()
    return message


def other_salt_job(load: str) -> str:
    """Load a checkpoint of MANAGED_TABLES into the same tables but for table m0's salt: the
    error each rank raises."""
    strategy = mp.ManualParallelStrategy()
    tables = [
        replace(t, raw_ids=ManagedCollisions(bucket_rows=4, salt=7)) if t.name == "m0" else t
        for t in MANAGED_TABLES
    ]
    emb = sharded(tables, strategy)
    try:
        strategy.load_checkpoint(load, {"model": emb})
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    else:
        message = "no error"
    strategy.teardown()
    return message
