"""A disk-tier checkpoint keeps the tier's memory bound (reliability row 77): saving and loading
a disk table streams its file in small chunks, so a rank's peak RSS grows by well under 64 MiB
over its training peak, however large the block (it grew by about the whole block before)."""

from __future__ import annotations

import resource

import torch

import manualpar as mp
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    on_disk,
    row_wise,
    shard_embeddings,
)
from manualpar.testing import run_distributed

MIB = 2**20
ROWS, DIM = 600_000, 32  # a 79 MB block (weights and a row-wise sum) on the one rank


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _train_save_load(directory: str) -> dict[str, float]:
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        ebc = EmbeddingBagCollection([EmbeddingBagConfig("big", ROWS, DIM)], seed=0)
    plan = EmbeddingPlan(1, {"big": on_disk(row_wise())})
    tier = DiskTier(f"{directory}/tier", cache_rows=20_000)
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.01), disk_tier=tier)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, ROWS, (256 * 20,), generator=generator)
        emb(SparseFeatures(["big"], ids, torch.full((256,), 20))).values.sum().backward()
    trained = _peak_mib()
    strategy.save_checkpoint(f"{directory}/ckpt", {"emb": emb})
    saved = _peak_mib()
    strategy.load_checkpoint(f"{directory}/ckpt", {"emb": emb})
    loaded = _peak_mib()
    strategy.teardown()
    return {"trained": trained, "saved": saved, "loaded": loaded}


def test_a_disk_tier_checkpoint_adds_little_to_the_training_peak(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (peaks,) = run_distributed(_train_save_load, 1, args=(str(tmp_path),), timeout=120)
    assert peaks["saved"] - peaks["trained"] < 64, peaks
    assert peaks["loaded"] - peaks["trained"] < 64, peaks
