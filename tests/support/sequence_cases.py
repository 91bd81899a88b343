"""Tables, batches and the single-process reference for the sequence (unpooled) embedding tests.

The reference trains the unsharded EmbeddingCollection (rows are `F.embedding` lookups with
sparse gradients) with torch's SGD, Adagrad and SparseAdam, or the row-wise Adagrad rule written
out on the coalesced gradient, as embedding_cases does for bags (its optimizers, seed and
tolerance are shared). Each rank's loss is a mean over its local samples of a nonlinear function
of every returned row; the reference's loss is the mean of the ranks' losses (or their sample-
weighted mean for normalize_by="global_samples").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from embedding_cases import SEED, STEPS, ReferenceUpdates

from manualpar.embeddings import (
    EmbeddingCollection,
    EmbeddingConfig,
    EmbeddingPlan,
    SequenceEmbeddings,
    SparseFeatures,
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)

TABLES = (
    EmbeddingConfig("history", 40, 6),
    EmbeddingConfig("cat", 29, 4, feature_names=("cat_a", "cat_b")),
    EmbeddingConfig("shop", 11, 3),
    EmbeddingConfig("brand", 23, 5),
)
FEATURES = tuple(f for t in TABLES for f in t.feature_names)
# ids per sample drawn from [0, MAX_IDS[f]]: the features' id counts differ, so the sharded
# collection pads them to different extents
MAX_IDS = {"history": 6, "cat_a": 3, "cat_b": 1, "shop": 4, "brand": 2}


def uniform_plan(kind: str, world: int) -> EmbeddingPlan:
    make = {
        "table_wise": lambda i: table_wise(i % world),
        "row_wise": lambda i: row_wise(),
        "column_wise": lambda i: column_wise(tuple(range(world))),
    }[kind]
    return EmbeddingPlan(world, {t.name: make(i) for i, t in enumerate(TABLES)})


def mixed_plan(world: int) -> EmbeddingPlan:
    """Table-wise, row-wise, column-wise (ranks reversed), data-parallel and table-row-wise."""
    return EmbeddingPlan(
        world,
        {
            "history": row_wise(),
            "cat": column_wise(tuple(reversed(range(world)))),
            "shop": data_parallel(),
            "brand": table_row_wise(0, world) if world > 1 else table_wise(0),
        },
    )


def plan_named(name: str, world: int) -> EmbeddingPlan:
    return mixed_plan(world) if name == "mixed" else uniform_plan(name, world)


def make_batch(rank: int, step: int, batch: int) -> SparseFeatures:
    """Random histories (empty ones included), duplicate ids likely; keys not in the tables'
    order."""
    generator = torch.Generator().manual_seed(2000 * rank + step)
    bags = {}
    for table in TABLES:
        for feature in table.feature_names:
            lengths = torch.randint(0, MAX_IDS[feature] + 1, (batch,), generator=generator)
            bags[feature] = [
                torch.randint(0, table.num_embeddings, (int(n),), generator=generator).tolist()
                for n in lengths
            ]
    keys = list(reversed(bags))
    return SparseFeatures.from_dict({k: bags[k] for k in keys})


def local_loss(out: SequenceEmbeddings, rank: int, step: int, batch: int) -> torch.Tensor:
    """Mean over the local samples of a sum over every returned row of a nonlinear function."""
    total = None
    for index, feature in enumerate(FEATURES):
        rows = out[feature].values
        generator = torch.Generator().manual_seed(300 + 100 * rank + 10 * step + index)
        coef = torch.randn(rows.shape, generator=generator)
        term = ((rows * coef).sum(1) - 0.3).square().sum()
        total = term if total is None else total + term
    assert total is not None
    return total / max(batch, 1)


def reference(
    opt_name: str, batch_sizes: Sequence[int], normalize: str = "world_size"
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor], dict[str, dict]]:
    """Each rank's step-0 rows per feature, then tables and optimizer state after STEPS."""
    ec = EmbeddingCollection(TABLES, seed=SEED)
    params = {name: table.weight for name, table in ec.tables.items()}
    updates = ReferenceUpdates(opt_name, params)
    world, total = len(batch_sizes), sum(batch_sizes)
    first: list[dict[str, torch.Tensor]] = []
    for step in range(STEPS):
        loss = torch.zeros(())
        for rank, batch in enumerate(batch_sizes):
            out = ec(make_batch(rank, step, batch))
            if step == 0:
                first.append({k: v.values.detach().clone() for k, v in out.to_dict().items()})
            weight = 1 / world if normalize == "world_size" else batch / total
            loss = loss + weight * local_loss(out, rank, step, batch)
        for p in params.values():
            p.grad = None
        loss.backward()
        updates.step()
    return first, {name: p.detach().clone() for name, p in params.items()}, updates.state()
