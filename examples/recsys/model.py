"""DLRM: sharded embedding tables, a bottom MLP over dense features, a top MLP over interactions.

Built on the meta device (`with mp.empty_init(): model = DLRM(...)`), nothing is allocated
until `setup(strategy)`: shard_embeddings then allocates only this rank's shards (initialized
with the values the unsharded tables would have), materialize() allocates the two small MLPs,
and ddp() wraps them. The tables are trained by a fused row-wise Adagrad inside backward; the
Trainer's dense optimizer (configure_optimizers) sees only the MLPs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from metrics import distributed_auc
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import manualpar as mp
from manualpar.data import CriteoBatch
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    row_wise,
    shard_embeddings,
    table_wise,
)


class MLP(nn.Sequential):
    """nn.Sequential with its forward written here. Under torch.compile(model) with several
    ranks, DDP's forward breaks the graph before it calls the module it wraps, and torch.compile
    starts tracing again only in code outside torch: a bare nn.Sequential under ddp() would run
    eagerly, this one is compiled. Same parameters and state_dict keys as nn.Sequential."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


def mlp(sizes: Sequence[int], *, last_relu: bool) -> MLP:
    """Linear layers with ReLUs between them (and after the last: the bottom MLP's output is a
    vector like the embeddings, as in DLRM; the top MLP ends in a logit)."""
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        if last_relu or index < len(sizes) - 2:
            layers.append(nn.ReLU())
    return MLP(*layers)


def make_plan(
    kind: str, tables: Sequence[EmbeddingBagConfig], world_size: int
) -> str | EmbeddingPlan:
    """ "auto" (left to shard_embeddings' planner), "table_wise" (whole tables, largest first to
    the emptiest rank), "row_wise" (every table split by rows over all ranks), or the path of a
    plan saved with plan.to_json() (e.g. a run's plan.json, edited)."""
    if kind == "auto":
        return "auto"
    if kind == "row_wise":
        return EmbeddingPlan(world_size, {t.name: row_wise() for t in tables})
    if kind == "table_wise":
        load, placements = [0] * world_size, {}
        for table in sorted(tables, key=lambda t: t.num_bytes, reverse=True):
            rank = load.index(min(load))
            placements[table.name] = table_wise(rank)
            load[rank] += table.num_bytes
        return EmbeddingPlan(world_size, {t.name: placements[t.name] for t in tables})
    return EmbeddingPlan.from_json(Path(kind).read_text())


def table_mesh(kind: str, strategy: mp.ManualParallelStrategy) -> DeviceMesh | None:
    """ "1d" (tables sharded over every rank), "2d" (sharded over each node's processes,
    replicated across nodes: the table all-to-alls stay inside a node) or "RxS" (explicit
    replicate x shard sizes)."""
    if kind == "1d":
        return None
    if kind == "2d":
        shard = strategy.environment.local_world_size
        return strategy.mesh(replicate=strategy.world_size // shard, shard=shard)
    replicas, _, shards = kind.partition("x")
    if not (replicas.isdigit() and shards.isdigit()):
        raise ValueError(f"--mesh takes 1d, 2d or RxS (e.g. 2x2), got {kind!r}")
    return strategy.mesh(replicate=int(replicas), shard=int(shards))


class DLRM(mp.ParallelModule):
    """Click-through-rate model of DLRM's shape (Naumov et al., 2019).

    interaction="dot": pairwise dot products of the pooled embeddings and the bottom MLP's
    output (all of width `dim`), concatenated with that output; "cat": plain concatenation.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        *,
        num_dense: int = 13,
        bottom: Sequence[int] = (64,),
        top: Sequence[int] = (64, 32),
        interaction: str = "dot",
        plan: str = "auto",
        emb_lr: float = 0.05,
        lr: float = 1e-3,
        seed: int = 0,
        memory_budget_bytes: int | None = None,
        mesh: str = "1d",
        wire_dtype: str = "fp32",
    ) -> None:
        super().__init__()
        self.mesh_kind = mesh
        self.wire_dtype = wire_dtype  # the exchanges' dtype by its short name, e.g. "bf16"
        self.dim = tables[0].embedding_dim
        if any(t.embedding_dim != self.dim for t in tables):
            raise ValueError("DLRM needs one embedding_dim for all tables")
        if interaction not in ("dot", "cat"):
            raise ValueError(f"interaction must be 'dot' or 'cat', got {interaction!r}")
        self.tables, self.interaction, self.plan_kind = tuple(tables), interaction, plan
        self.emb_lr, self.lr, self.seed = emb_lr, lr, seed
        self.memory_budget_bytes = memory_budget_bytes
        vectors = len(tables) + 1
        top_in = (
            vectors * (vectors - 1) // 2 + self.dim if interaction == "dot" else vectors * self.dim
        )
        # (sharded and wrapped in setup)
        self.embeddings: EmbeddingBagCollection | ShardedEmbeddingBagCollection = (
            EmbeddingBagCollection(tables, seed=seed)
        )
        self.bottom: nn.Module = mlp([num_dense, *bottom, self.dim], last_relu=True)
        self.top: nn.Module = mlp([top_in, *top, 1], last_relu=False)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        mesh = table_mesh(self.mesh_kind, strategy)
        shard_ranks = strategy.world_size if mesh is None else int(mesh.shape[1])
        plan = make_plan(self.plan_kind, self.tables, shard_ranks)
        assert isinstance(self.embeddings, EmbeddingBagCollection)  # (setup runs once)
        self.embeddings = shard_embeddings(
            self.embeddings,
            strategy,
            plan=plan,
            rule=RowWiseAdagrad(lr=self.emb_lr),
            memory_budget_bytes=self.memory_budget_bytes,
            mesh=mesh,
            wire_dtype=self.wire_dtype,
        )
        mp.materialize(self, strategy, seed=self.seed)  # the MLPs: the same values on every rank
        self.bottom = mp.ddp(self.bottom, strategy)
        self.top = mp.ddp(self.top, strategy)

    def prefetch(self, batch: CriteoBatch) -> None:
        """Send the next batch's ids to their owners now: the Trainer calls this before each
        step with the next step's batch, so they travel during the step (TrainPipeline)."""
        assert isinstance(self.embeddings, ShardedEmbeddingBagCollection)  # (after setup)
        self.embeddings.prefetch(batch.sparse)

    def forward(self, batch: CriteoBatch) -> torch.Tensor:
        """Logits (B,)."""
        device = self.strategy.device if self.strategy is not None else torch.device("cpu")
        pooled = self.embeddings(batch.sparse).values  # (B, tables * dim); eager under compile
        return self.dense_forward(batch.dense.to(device), pooled)

    def dense_forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits (B,) from the dense features (B, 13) and the pooled embeddings: the dense part,
        the one torch.compile(model) compiles (the table lookup before it stays eager)."""
        device = dense_features.device
        dense = self.bottom(dense_features)  # (B, dim)
        pooled = rearrange(pooled, "b (f d) -> b f d", d=self.dim)
        vectors = torch.cat([rearrange(dense, "b d -> b 1 d"), pooled], dim=1)  # (B, 27, dim)
        if self.interaction == "dot":
            gram = einsum(vectors, vectors, "b f d, b g d -> b f g")
            i, j = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1, device=device)
            features = torch.cat([dense, gram[:, i, j]], dim=1)
        else:
            features = rearrange(vectors, "b f d -> b (f d)")
        return rearrange(self.top(features), "b 1 -> b")

    def training_step(self, batch: CriteoBatch, step: int) -> dict[str, torch.Tensor]:
        logits = self(batch)
        labels = batch.labels.to(logits.device)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        accuracy = ((logits > 0) == (labels > 0.5)).float().mean()
        return {"loss": loss, "accuracy": accuracy.detach()}

    @torch.no_grad()
    def validation_step(self, batch: CriteoBatch) -> dict[str, float]:
        """AUC and log loss of the whole validation set (every rank's share gathered)."""
        assert self.strategy is not None
        logits = self(batch)
        labels = batch.labels.to(logits.device)
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        count = torch.tensor(float(len(batch)), device=logits.device)
        totals = self.strategy.all_reduce(torch.stack([loss, count]), op="sum")
        return {
            "auc": distributed_auc(self.strategy, logits, labels),
            "loss": float(totals[0] / totals[1]),
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=self.lr)
