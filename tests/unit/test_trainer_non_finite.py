"""The Trainer and non_finite="skip" (reliability row 76): a step whose loss is NaN leaves the
sharded tables and the dense parameters as they were, is logged as skipped, and training goes
on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import manualpar as mp
from manualpar import full_tensors
from manualpar.embeddings import SGD, SparseFeatures, shard_embeddings

NAN_STEP = 1


class _Tower(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = mp.EmbeddingBagCollection([mp.EmbeddingBagConfig("t", 8, 2)], seed=1)
        self.fc = nn.Linear(2, 1)
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.emb = shard_embeddings(self.emb, strategy, "auto", SGD(lr=0.1), non_finite="skip")

    def training_step(self, batch: SparseFeatures, step: int) -> torch.Tensor:
        with full_tensors():
            table = self.emb.state_dict()["tables.t.weight"].clone()
        self.snapshots.append((table, self.fc.weight.detach().clone()))
        loss = self.fc(self.emb(batch).values).square().mean()
        return loss * float("nan") if step == NAN_STEP else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.dense_parameters(), lr=0.1)


def _batch(step: int, strategy: mp.ManualParallelStrategy) -> SparseFeatures:
    return SparseFeatures.from_dict({"t": [[step % 8], [(step + 3) % 8, 5]]})


def test_a_skipped_sparse_update_skips_the_dense_step_too(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    model = _Tower()
    model.setup(strategy)
    trainer = mp.Trainer(strategy, tmp_path, max_steps=3, progress=False, log_every=1)
    trainer.fit(model, _batch)
    (t0, w0), (t1, w1), (t2, w2) = model.snapshots
    assert not torch.equal(t1, t0) and not torch.equal(w1, w0)  # step 0 trained
    assert torch.equal(t2, t1) and torch.equal(w2, w1)  # the NaN step changed nothing
    assert model.emb.skipped_updates == 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if r.get("skipped_non_finite")]
    assert skipped == [NAN_STEP + 1]  # logged with the step count after it


class _Branches(mp.ParallelModule):
    """Sparse and dense branches added in the loss: a NaN in the dense one never reaches the
    tables' output gradient. `nan_at`: (micro-batch index, branch) pairs made NaN."""

    def __init__(
        self, nan_at: set[tuple[int, str]], non_finite: str = "skip", disk: Path | None = None
    ) -> None:
        super().__init__()
        self.disk = disk  # the table on disk behind a 5-row cache: slots are reused
        torch.manual_seed(0)  # the dense layers' init: runs compare
        self.emb = mp.EmbeddingBagCollection([mp.EmbeddingBagConfig("t", 8, 2)], seed=1)
        self.fc = nn.Linear(2, 1)
        self.dense = nn.Linear(3, 1)
        self.nan_at, self.non_finite = nan_at, non_finite
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        tier = None if self.disk is None else mp.embeddings.DiskTier(self.disk, cache_rows=5)
        plan = {"t": mp.embeddings.row_wise(on_disk=True)} if tier else "auto"
        self.emb = shard_embeddings(
            self.emb,
            strategy,
            plan,
            mp.embeddings.Adam(lr=0.1),
            non_finite=self.non_finite,
            disk_tier=tier,
        )

    def state(self) -> dict[str, torch.Tensor]:
        with full_tensors():
            tables = {k: v.clone() for k, v in self.emb.state_dict().items()}
            sparse = self.emb.fused_optimizer.state_dict()
        dense = {k: v.detach().clone() for k, v in self.named_parameters() if "emb" not in k}
        state = {
            f"{table}.{key}": value.clone()
            for table, entries in sparse["state"].items()
            for key, value in entries.items()
        }
        return {**tables, **dense, **state, "updates": torch.tensor(sparse["step"])}

    def training_step(self, batch: SparseFeatures, index: int) -> torch.Tensor:
        self.snapshots.append(self.state())
        sparse = self.fc(self.emb(batch).values).square().mean()
        dense = self.dense(torch.ones(2, 3)).square().mean()
        if (index, "sparse") in self.nan_at:
            sparse = sparse * float("nan")
        if (index, "dense") in self.nan_at:
            dense = dense * float("nan")
        return sparse + dense

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=0.1)


def _fit(tmp_path: Path, model: _Branches, steps: int, **kwargs: object) -> mp.Trainer:
    strategy = mp.ManualParallelStrategy()
    model.setup(strategy)
    settings: dict = {"max_steps": steps, "progress": False, "log_every": 1, **kwargs}
    trainer = mp.Trainer(strategy, tmp_path, **settings)
    trainer.fit(model, _batch)
    return trainer


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_a_nan_only_in_a_dense_branch_raises_naming_the_parameter(tmp_path: Path) -> None:
    model = _Branches({(1, "dense")}, non_finite="raise")
    with pytest.raises(mp.NonFiniteError) as raised:
        _fit(tmp_path, model, 3, checkpoint_every=1)
    message = str(raised.value)
    assert message.startswith("Trainer: step 2: the dense gradients hold non-finite values")
    assert "'dense.weight'" in message and "'dense.bias'" in message
    assert "'fc.weight'" not in message
    assert "non_finite='skip'" in message
    # the dense optimizer never stepped on it: the weights and Adam's state stay finite
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.dense.weight.grad is not None
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["step_00000001"]  # step 1 only, saved before the NaN


def test_skip_drops_a_dense_nan_step_whole_sparse_update_included(tmp_path: Path) -> None:
    model = _Branches({(1, "dense")})
    _fit(tmp_path, model, 3)  # the tables skip, so the Trainer skips too by default
    before, after = model.snapshots[1], model.snapshots[2]
    _assert_same(before, after)  # neither the dense step nor the finite sparse update
    assert not torch.equal(model.snapshots[0]["tables.t.weight"], before["tables.t.weight"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped_non_finite")] == [2]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_accumulated_step_with_one_nan_micro_batch_is_dropped_whole(tmp_path: Path) -> None:
    # step 1 holds micro-batches 2 and 3; 3's table gradient is NaN, 2 was finite and updated
    model = _Branches({(3, "sparse")})
    _fit(tmp_path, model, 3, accumulate=2, clip_grad_norm=1.0)
    start, first_micro, next_step = model.snapshots[2], model.snapshots[3], model.snapshots[4]
    assert not torch.equal(first_micro["tables.t.weight"], start["tables.t.weight"])
    _assert_same(start, next_step)  # micro-batch 2's sparse update undone, no dense step
    assert int(model.emb.fused_optimizer.num_updates) == 4  # steps 0 and 2, two each
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped_non_finite")] == [2]
    # on disk behind a 5-row cache (slots reused between steps): the run ends as the one whose
    # both micro-batches were NaN (each dropped by the table's own check, before its update)
    runs = []
    for nan_at in ({(3, "sparse")}, {(2, "sparse"), (3, "sparse")}):
        on_disk = _Branches(nan_at, disk=tmp_path / f"rows{len(nan_at)}")
        _fit(tmp_path / f"disk{len(nan_at)}", on_disk, 3, accumulate=2, clip_grad_norm=1.0)
        runs.append(on_disk.state())
    _assert_same(runs[0], runs[1])


def test_a_frozen_tables_inf_gradient_is_not_a_fault() -> None:
    strategy = mp.ManualParallelStrategy()
    configs = [mp.EmbeddingBagConfig("a", 8, 2), mp.EmbeddingBagConfig("b", 8, 2)]
    ebc = mp.EmbeddingBagCollection(configs, seed=1)
    ebc.tables["b"].weight.requires_grad_(False)
    emb = shard_embeddings(ebc, strategy, "auto", SGD(lr=0.1))
    with full_tensors():
        before = {k: v.clone() for k, v in emb.state_dict().items()}
    batch = SparseFeatures.from_dict({"a": [[1], [2]], "b": [[3], [4]]})
    values = emb(batch).values  # columns 0-1: table a, 2-3: table b (frozen)
    (values[:, :2].sum() + (values[:, 2:] * float("inf")).sum()).backward()
    with full_tensors():
        after = emb.state_dict()
    assert not torch.equal(after["tables.a.weight"], before["tables.a.weight"])
    assert torch.equal(after["tables.b.weight"], before["tables.b.weight"])
    assert emb.skipped_updates == 0
