"""A drain rewrites the chunks where logged rows are dense through one buffer of its thread (a
fresh tensor a chunk took its pages anew each time), and the table trained equals the
in-memory one, step for step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
)
from manualpar.embeddings.storage import disk_tier, write_log
from manualpar.embeddings.storage.row_file import RowFile

TABLES = (EmbeddingBagConfig("big", 400, 4),)


def _train(tier: DiskTier | None, steps: int) -> torch.Tensor:
    with mp.empty_init():
        ebc = EmbeddingBagCollection(TABLES, seed=3)
    plan = EmbeddingPlan(1, {"big": row_wise(on_disk=tier is not None)})
    emb = shard_embeddings(
        ebc, mp.ManualParallelStrategy(), plan, RowWiseAdagrad(lr=0.1), disk_tier=tier
    )
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        ids = torch.randint(0, 400, (60,), generator=generator)
        batch = SparseFeatures(["big"], ids, torch.full((20,), 3, dtype=torch.int64))
        emb(batch).values.square().sum().backward()
    with full_tensors():
        return emb.state_dict()["tables.big.weight"].clone()


def test_a_drain_rewrites_its_chunks_through_one_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(write_log, "DENSE_SHARE", 64)  # a chunk with a logged row: whole
    monkeypatch.setattr(disk_tier, "FLUSH_CHUNK_BYTES", 64 * 20)  # 64-row chunks (20-byte rows)
    buffers: list[int] = []  # the drain's chunk reads (a flush's come without a buffer)
    read_range = RowFile.read_range

    def spy(self: RowFile, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None:
            buffers.append(out.untyped_storage().data_ptr())
        return read_range(self, start, end, out)

    monkeypatch.setattr(RowFile, "read_range", spy)
    disk = _train(DiskTier(tmp_path, cache_rows=64, write_log=2.0), steps=40)
    assert len(buffers) > 5 and len(set(buffers)) <= 2  # the drain thread's and this thread's
    assert torch.equal(disk, _train(None, steps=40))
