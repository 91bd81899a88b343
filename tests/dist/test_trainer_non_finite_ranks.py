"""Trainer steps dropped whole on every rank (reliability rows 76 and on): with accumulate=2, a
NaN in one rank's second micro-batch undoes the first micro-batch's sparse update on every
rank; a NaN only in one rank's dense gradient (a parameter no collective averages) skips the
step on every rank, sparse updates included."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import manualpar as mp
from manualpar import full_tensors
from manualpar.embeddings import Adam, SparseFeatures, row_wise, shard_embeddings
from manualpar.testing import run_distributed

# micro-batch index -> the branch made NaN on rank 1 only
NAN_ON_RANK_1 = {3: "sparse", 4: "dense"}


class _Branches(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = mp.EmbeddingBagCollection([mp.EmbeddingBagConfig("t", 8, 2)], seed=1)
        self.fc = nn.Linear(2, 1)
        self.dense = nn.Linear(3, 1)  # not wrapped: each rank's gradient is its own
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.rank = strategy.rank
        plan = {"t": row_wise()}
        self.emb = shard_embeddings(self.emb, strategy, plan, Adam(lr=0.1), non_finite="skip")

    def training_step(self, batch: SparseFeatures, index: int) -> torch.Tensor:
        with full_tensors():
            state = {k: v.clone() for k, v in self.emb.state_dict().items()}
        state.update({k: v.detach().clone() for k, v in self.named_parameters() if "emb" not in k})
        self.snapshots.append(state)
        sparse = self.fc(self.emb(batch).values).square().mean()
        dense = self.dense(torch.ones(2, 3)).square().mean()
        bad = NAN_ON_RANK_1.get(index) if self.rank == 1 else None
        sparse = sparse * float("nan") if bad == "sparse" else sparse
        dense = dense * float("nan") if bad == "dense" else dense
        return sparse + dense

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.dense_parameters(), lr=0.1)


def _batch(index: int, strategy: mp.ManualParallelStrategy) -> SparseFeatures:
    r = strategy.rank
    return SparseFeatures.from_dict({"t": [[index % 8, (index + 4 + r) % 8], [(3 * r + 1) % 8]]})


def _fit(out_dir: str) -> dict:
    strategy = mp.ManualParallelStrategy()
    model = _Branches()
    model.setup(strategy)
    trainer = mp.Trainer(strategy, out_dir, max_steps=4, accumulate=2, progress=False, log_every=1)
    trainer.fit(model, _batch)
    result = {"snapshots": model.snapshots, "skipped": model.emb.skipped_updates}
    strategy.teardown()
    return result


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(value, b[key]) for key, value in a.items())


def test_a_nan_on_one_rank_drops_the_whole_accumulated_step_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_fit, 2, args=(str(tmp_path),), timeout=90)
    for rank, result in enumerate(results):
        shots = result["snapshots"]  # before micro-batches 0..7: steps start at 0, 2, 4, 6
        assert not _same(shots[2], shots[3]), rank  # micro-batch 2 updated the rows...
        assert _same(shots[2], shots[4]), rank  # ...and was undone with micro-batch 3's NaN
        assert _same(shots[4], shots[6]), rank  # rank 1's dense NaN: skipped here too
        assert not _same(shots[6], shots[7]), rank  # training goes on
        assert result["skipped"] == 4, rank  # micro-batches 2, 3 (NaN), 4 and 5 dropped
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped_non_finite")] == [2, 3]
