"""Loading a checkpoint into a disk table: the checkpoint's rows stream into the file, without
the table first generated and written whole; rows the load did not write (optimizer state of a
model-only load, weights of a state-only load, a failed load's leftovers) keep their values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors, loading
from manualpar.embeddings import (
    Adagrad,
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    SparseFeatures,
    row_wise,
    shard_embeddings,
)
from manualpar.embeddings.storage import disk_tier

ROWS = 96
TABLES = (EmbeddingBagConfig("big", ROWS, 4),)
INITIAL = 0.25  # a nonzero initial accumulator: the file's reserved zeros are not it


def _collection(directory: Path | None) -> Any:
    """The table on disk (in `directory`, 16 cached rows) or in memory (None)."""
    with mp.empty_init():
        ebc = EmbeddingBagCollection(TABLES, seed=3)
    placement = row_wise(on_disk=True) if directory is not None else row_wise()
    tier = DiskTier(directory, cache_rows=16) if directory is not None else None
    return shard_embeddings(
        ebc,
        mp.ManualParallelStrategy(),
        EmbeddingPlan(1, {"big": placement}),
        Adagrad(lr=0.1, initial_accumulator_value=INITIAL),
        disk_tier=tier,
    )


def _train(emb: Any, steps: range) -> None:
    for step in steps:
        ids = torch.randint(0, ROWS, (12,), generator=torch.Generator().manual_seed(step))
        pooled = emb(SparseFeatures(["big"], ids, torch.full((6,), 2))).values
        (pooled - 0.5).square().sum().backward()


def _snapshot(emb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    with full_tensors():
        weight = emb.state_dict()["tables.big.weight"].clone()
        return weight, emb.fused_optimizer.state_dict()["state"]["big"]["sum"].clone()


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, tuple[torch.Tensor, torch.Tensor]]:
    """A checkpoint of a table trained 3 steps on disk (few rows touched), and its values."""
    emb = _collection(tmp_path / "saved")
    _train(emb, range(3))
    path = tmp_path / "ckpt"
    mp.ManualParallelStrategy().save_checkpoint(
        path, {"model": emb, "sparse_optim": emb.fused_optimizer}
    )
    return path, _snapshot(emb)


def _generated_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the rows the disk tier generates from the table's initializer, whole-table passes
    (flush) included."""
    counted: list[int] = []
    original = disk_tier.init_rows

    def counting(config: Any, seed: int, rows: tuple[int, int], *args: Any, **kw: Any) -> Any:
        counted.append(rows[1] - rows[0])
        return original(config, seed, rows, *args, **kw)

    monkeypatch.setattr(disk_tier, "init_rows", counting)
    return counted


def test_a_model_only_load_writes_no_generated_table_and_keeps_initial_state(
    tmp_path: Path, trained: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, (weight, _) = trained
    generated = _generated_rows(monkeypatch)
    strategy = mp.ManualParallelStrategy()
    disk = _collection(tmp_path / "loaded")
    strategy.load_checkpoint(path, {"model": disk})
    assert generated == []  # before: the whole table generated and written, then overwritten
    memory = _collection(None)
    strategy.load_checkpoint(path, {"model": memory})
    loaded, state = _snapshot(disk)
    assert torch.equal(loaded, weight)
    assert torch.equal(state, torch.full_like(state, INITIAL))  # not the file's zeros
    _train(disk, range(3, 6))
    _train(memory, range(3, 6))
    for on_disk_value, in_memory in zip(_snapshot(disk), _snapshot(memory), strict=True):
        assert torch.equal(on_disk_value, in_memory)


def test_a_state_only_load_keeps_the_initial_weights(
    tmp_path: Path, trained: tuple[Path, Any]
) -> None:
    path, (_, state) = trained
    strategy = mp.ManualParallelStrategy()
    disk, memory = _collection(tmp_path / "loaded"), _collection(None)
    for emb in (disk, memory):
        strategy.load_checkpoint(path, {"sparse_optim": emb.fused_optimizer})
    assert torch.equal(_snapshot(disk)[1], state)
    assert torch.equal(_snapshot(disk)[0], _snapshot(memory)[0])  # the seeded initial values


def test_a_full_load_after_an_abandoned_one(tmp_path: Path, trained: tuple[Path, Any]) -> None:
    """Views handed out to a load that never finished (it failed after writing some rows) do
    not leave their bytes behind as the optimizer state of a later model-only load."""
    path, (weight, _) = trained
    disk = _collection(tmp_path / "loaded")
    with loading():
        blocks = disk.fused_optimizer.state_dict()["state"]["big"]["sum"].blocks
        for block in blocks:
            block.tensor.fill_(7.0)  # what a failed read left in the file
    mp.ManualParallelStrategy().load_checkpoint(path, {"model": disk})
    loaded, state = _snapshot(disk)
    assert torch.equal(loaded, weight)
    assert torch.equal(state, torch.full_like(state, INITIAL))
