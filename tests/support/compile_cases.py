"""torch.compile on a model with sharded tables: the same training run eager and compiled.

The model has the recommender example's shape at toy size: sharded tables (the mixed plan, every
placement side by side), a bottom MLP over dense features and a top MLP over the bottom's output
and the pooled embeddings, both MLPs under ddp(). Each run trains STEPS steps (tables by their
fused optimizer inside backward, the MLPs by Adam) on the same batches from the same seeds, and
returns its losses, the full tables and the MLP weights, so a compiled run can be compared with
an eager one number by number.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from embedding_cases import SEED, TABLES, make_batch, mixed_plan
from torch import nn

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import EmbeddingBagCollection, RowWiseAdagrad, shard_embeddings

STEPS = 4
NUM_DENSE = 5
POOLED_DIM = sum(t.embedding_dim * len(t.feature_names) for t in TABLES)


class MLP(nn.Sequential):
    """A Sequential whose forward is defined here, as the recommender example's: torch.compile
    skips frames of torch's own modules, so a bare nn.Sequential under ddp() would run eagerly
    (DDP's forward breaks the graph before calling the module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


class TinyRecommender(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = EmbeddingBagCollection(TABLES, seed=SEED)
        self.bottom = MLP(nn.Linear(NUM_DENSE, 8), nn.ReLU())
        self.top = MLP(nn.Linear(8 + POOLED_DIM, 16), nn.ReLU(), nn.Linear(16, 1))

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        plan = mixed_plan(strategy.world_size)
        self.embeddings = shard_embeddings(self.embeddings, strategy, plan, RowWiseAdagrad(lr=0.1))
        mp.materialize(self, strategy, seed=SEED)
        self.bottom = mp.ddp(self.bottom, strategy)
        self.top = mp.ddp(self.top, strategy)

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        pooled = self.embeddings(sparse).values
        hidden = torch.cat([self.bottom(dense), pooled], dim=1)
        return self.top(hidden).squeeze(1)


def batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Dense features, sparse features (bags of 0 to 4 ids) and 0/1 labels of one step."""
    generator = torch.Generator().manual_seed(500 + 10 * rank + step)
    dense = torch.randn(size, NUM_DENSE, generator=generator)
    labels = torch.randint(0, 2, (size,), generator=generator).float()
    return dense, make_batch(rank, step, size), labels


def train(
    strategy: mp.ManualParallelStrategy, backend: Any, sizes: list[int], in_place: bool = False
) -> dict:
    """One run: eager when `backend` is None, else compiled with that backend, by
    torch.compile(model) or, `in_place`, model.compile(). `sizes[step]` is this rank's batch
    size at `step` (a change exercises dynamic shapes)."""
    with mp.empty_init():
        model = TinyRecommender()
    model.setup(strategy)
    optimizer = torch.optim.Adam(model.dense_parameters(), lr=0.01)
    step_fn: nn.Module = model
    if backend is not None and in_place:
        model.compile(backend=backend)
    elif backend is not None:
        step_fn = torch.compile(model, backend=backend)  # type: ignore[assignment]
    losses = []
    for step, size in enumerate(sizes):
        dense, sparse, labels = batch(strategy.rank, step, size)
        logits = step_fn(dense, sparse)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    with full_tensors():
        tables = {k: v for k, v in model.embeddings.state_dict().items() if k.startswith("tables")}
    dense_weights = {
        name: p.detach().clone() for name, p in model.named_parameters() if "embeddings" not in name
    }
    keys = sorted(model.state_dict())  # what the Trainer's checkpoints hold
    return {"losses": torch.stack(losses), "tables": tables, "dense": dense_weights, "keys": keys}


def compiled_and_eager(backend: str, sizes: list[list[int]], in_place: bool = False) -> dict:
    """On each rank: an eager run, then a compiled one from the same seeds (`sizes[rank]`: this
    rank's batch sizes), the number of graphs torch.compile produced and the names of the ops in
    them (so a test sees that the dense parts were compiled)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    strategy = mp.ManualParallelStrategy()
    mine = sizes[strategy.rank]
    eager = train(strategy, None, mine)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = train(strategy, counter, mine, in_place)
    strategy.teardown()
    ops = [
        getattr(n.target, "__name__", str(n.target))
        for g in counter.graphs
        for n in g.graph.nodes
        if "call" in n.op
    ]
    return {"eager": eager, "compiled": compiled, "graphs": counter.frame_count, "ops": ops}


def cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU kernels are built with ($CXX, else g++), or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


def assert_same_run(compiled: dict, eager: dict, where: str, rtol: float, atol: float) -> None:
    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(
            a, b, rtol=rtol, atol=atol, msg=lambda m: f"{where}, {what}: {m}"
        )

    close(compiled["losses"], eager["losses"], "losses")
    assert compiled["keys"] == eager["keys"], f"{where}: state_dict keys"
    assert set(compiled["tables"]) == set(eager["tables"])
    for name, value in eager["tables"].items():
        close(compiled["tables"][name], value, f"table {name}")
    for name, value in eager["dense"].items():
        close(compiled["dense"][name], value, f"dense parameter {name}")
