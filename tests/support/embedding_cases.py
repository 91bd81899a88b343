"""Shared tables, batches and the single-process reference for the sharded embedding tests.

The reference trains the unsharded EmbeddingBagCollection with torch's own sparse optimizers
(SGD, Adagrad, SparseAdam) or, for row-wise Adagrad, the rule written out on the coalesced
sparse gradient. Each rank's loss is a mean over its local batch and the reference's loss is
the mean of the ranks' losses, which is the gradient rule `shard_embeddings` promises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    SGD,
    Adagrad,
    Adam,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    SparseFeatures,
    UpdateRule,
    column_wise,
    data_parallel,
    row_wise,
    shard_embeddings,
    table_row_wise,
    table_wise,
)

TABLES = (
    EmbeddingBagConfig("t0", 50, 6),
    EmbeddingBagConfig("t1", 37, 4, feature_names=("f1a", "f1b")),
    EmbeddingBagConfig("t2", 23, 5),
    EmbeddingBagConfig("t3", 9, 3, pooling="mean"),
    EmbeddingBagConfig("t4", 41, 4),
    EmbeddingBagConfig("t5", 30, 7, pooling="mean", feature_names=("f5a", "f5b")),
)
FEATURES = tuple(f for t in TABLES for f in t.feature_names)
STEPS = 3
OPTIMIZERS = ("sgd", "adagrad", "rowwise", "adam")
SEED = 11


def optimizer(name: str) -> UpdateRule:
    return {
        "sgd": SGD(lr=0.5),
        "adagrad": Adagrad(lr=0.3),
        "rowwise": RowWiseAdagrad(lr=0.3),
        "adam": Adam(lr=0.05),
    }[name]


def mixed_plan(world: int) -> EmbeddingPlan:
    """Every kind of placement side by side (table-wise, row-wise, column-wise, table-row-wise,
    data-parallel)."""
    return EmbeddingPlan(
        world,
        {
            "t0": table_wise(world - 1),
            "t1": row_wise(),
            "t2": column_wise(tuple(reversed(range(world)))),
            "t3": data_parallel(),
            "t4": table_row_wise(0, world),
            "t5": column_wise((0, world - 1)) if world > 1 else table_wise(0),
        },
    )


def uniform_plan(kind: str, world: int) -> EmbeddingPlan:
    """Every table placed the same way."""
    make = {
        "table_wise": lambda i: table_wise(i % world),
        "row_wise": lambda i: row_wise(),
        "column_wise": lambda i: column_wise(tuple(range(world))),
        "table_row_wise": lambda i: table_row_wise(0, world),
        "data_parallel": lambda i: data_parallel(),
    }[kind]
    return EmbeddingPlan(world, {t.name: make(i) for i, t in enumerate(TABLES)})


def make_batch(
    rank: int,
    step: int,
    batch: int,
    weighted: bool = False,
    tables: Sequence[EmbeddingBagConfig] = TABLES,
) -> SparseFeatures:
    """Random bags (0 to 4 ids, some empty), duplicate ids likely; keys in a shuffled order."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    bags, weights = {}, {}
    for table in tables:
        for feature in table.feature_names:
            lengths = torch.randint(0, 5, (batch,), generator=generator).tolist()
            bags[feature] = [
                torch.randint(0, table.num_embeddings, (n,), generator=generator).tolist()
                for n in lengths
            ]
            weights[feature] = [torch.rand(n, generator=generator).tolist() for n in lengths]
    keys = list(bags)
    keys = keys[1:] + keys[:1]  # not the tables' order: the collection must reorder
    return SparseFeatures.from_dict(
        {k: bags[k] for k in keys}, {k: weights[k] for k in keys} if weighted else None
    )


def feature_bags(
    sizes: Sequence[tuple[int, int]],
    seed: int,
    batch: int,
    lengths: tuple[int, int] = (0, 3),
    id_cap: int | None = None,
) -> SparseFeatures:
    """Bags of `lengths` ids (low inclusive, high exclusive) for features f0, f1, ... of tables
    of `sizes` (rows, dim), feature i reading table i's rows (below `id_cap`, where given)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(*lengths, (len(sizes) * batch,), generator=g)
    per_table = counts.view(len(sizes), batch).sum(1).tolist()
    values = torch.cat(
        [
            torch.randint(0, rows if id_cap is None else min(rows, id_cap), (n,), generator=g)
            for (rows, _), n in zip(sizes, per_table, strict=True)
        ]
    )
    return SparseFeatures(tuple(f"f{i}" for i in range(len(sizes))), values, counts)


def one_process_tables(sizes: Sequence[tuple[int, int]]) -> ShardedEmbeddingBagCollection:
    """Tables of `sizes` (rows, dim), table i read by feature f<i> (`feature_bags`' batches),
    sharded in this one process with row-wise Adagrad."""
    configs = [
        EmbeddingBagConfig(f"t{i}", rows, dim, feature_names=(f"f{i}",))
        for i, (rows, dim) in enumerate(sizes)
    ]
    ebc = EmbeddingBagCollection(configs, seed=3)
    emb = shard_embeddings(ebc, mp.ManualParallelStrategy(), "auto", RowWiseAdagrad(lr=0.1))
    assert isinstance(emb, ShardedEmbeddingBagCollection)
    return emb


def coefficients(rank: int, step: int, batch: int, dim: int) -> torch.Tensor:
    return torch.randn(batch, dim, generator=torch.Generator().manual_seed(77 + 10 * rank + step))


def local_loss(pooled: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """Mean over the local batch of a nonlinear function of every pooled column."""
    coef = coefficients(rank, step, pooled.shape[0], pooled.shape[1])
    return ((pooled * coef).sum(1) - 0.5).square().mean() if pooled.shape[0] else pooled.sum()


def train_and_collect(
    emb: Any, rank: int, batch_size: int, weighted: bool = False
) -> dict[str, Any]:
    """STEPS steps of `local_loss` on a sharded collection: the step-0 pooled output (float32
    whatever the tables' dtype), then the full tables and fused optimizer state."""
    first = None
    for step in range(STEPS):
        pooled = emb(make_batch(rank, step, batch_size, weighted)).values
        assert pooled.dtype == torch.float32, pooled.dtype
        if step == 0:
            first = pooled.detach().clone()
        local_loss(pooled, rank, step).backward()
    with full_tensors():
        weights = {k.split(".")[1]: v for k, v in emb.state_dict().items()}
        state = emb.fused_optimizer.state_dict()["state"]
    return {"first": first, "tables": weights, "state": state}


def reference(
    opt_name: str,
    batch_sizes: Sequence[int],
    weighted: bool = False,
    normalize: str = "world_size",
    tables: Sequence[EmbeddingBagConfig] = TABLES,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, dict]]:
    """Outputs of step 0 per rank, then tables and optimizer state after STEPS steps."""
    ebc = EmbeddingBagCollection(tables, seed=SEED)
    params = {name: table.weight for name, table in ebc.tables.items()}
    updates = ReferenceUpdates(opt_name, params)
    world, total = len(batch_sizes), sum(batch_sizes)
    first_outputs = []
    for step in range(STEPS):
        loss = 0
        for rank, batch in enumerate(batch_sizes):
            pooled = ebc(make_batch(rank, step, batch, weighted, tables)).values
            if step == 0:
                first_outputs.append(pooled.detach().clone())
            weight = 1 / world if normalize == "world_size" else batch / total
            loss = loss + weight * local_loss(pooled, rank, step)
        for p in params.values():
            p.grad = None
        loss.backward()
        updates.step()
    tables_after = {name: p.detach().clone() for name, p in params.items()}
    return first_outputs, tables_after, updates.state()


class ReferenceUpdates:
    """The reference updates of sparse table gradients: torch's SGD, Adagrad and SparseAdam, and
    row-wise Adagrad written out (torch has none); `state()` in the fused optimizer's layout."""

    def __init__(self, opt_name: str, params: dict[str, torch.Tensor]) -> None:
        self.opt_name, self.params, self.rule = opt_name, params, optimizer(opt_name)
        rule = self.rule
        make = {
            "sgd": lambda p: torch.optim.SGD(p, lr=rule.lr),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=rule.lr, eps=rule.eps),
            "adam": lambda p: torch.optim.SparseAdam(p, lr=rule.lr, betas=rule.betas, eps=rule.eps),
            "rowwise": None,
        }[opt_name]
        self.opt = make(list(params.values())) if make else None
        self.row_state = {name: torch.zeros(p.shape[0]) for name, p in params.items()}

    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()
            return
        with torch.no_grad():
            for name, p in self.params.items():
                if p.grad is None:
                    continue
                grad = p.grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
                self.row_state[name][rows] += values.square().mean(1)
                scale = self.row_state[name][rows].sqrt() + self.rule.eps
                p[rows] -= self.rule.lr * values / scale[:, None]

    def state(self) -> dict[str, dict]:
        state: dict[str, dict] = {}
        for name, p in self.params.items():
            if self.opt_name == "rowwise":
                state[name] = {"sum": self.row_state[name]}
            elif self.opt_name == "adagrad":
                state[name] = {"sum": self.opt.state[p]["sum"].to_dense()}
            elif self.opt_name == "adam":
                keys = ("exp_avg", "exp_avg_sq")
                state[name] = {k: self.opt.state[p][k].to_dense() for k in keys}
            else:
                state[name] = {}
        return state


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
