"""The Trainer records managed-collision tables' collision and eviction rates per log window
in metrics.jsonl (and returns them from fit), against the counts of a replayed remapper."""

from __future__ import annotations

import json

import torch
from torch import nn

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    SparseFeatures,
    shard_embeddings,
)

TABLES = [
    EmbeddingBagConfig("t", 8, 2, raw_ids=mp.ManagedCollisions(bucket_rows=4)),
    EmbeddingBagConfig("u", 6, 2, raw_ids=mp.ManagedCollisions(policy="lfu", bucket_rows=3)),
]


def _batch(step: int, strategy: object = None) -> SparseFeatures:
    """4 samples of 2 raw ids per table, from 20 ids: buckets overflow."""
    generator = torch.Generator().manual_seed(step)
    return SparseFeatures.from_dict(
        {
            name: (torch.randint(0, 20, (4, 2), generator=generator) * 1000 - 7).tolist()
            for name in ("t", "u")
        }
    )


class _Model(nn.Module):
    def __init__(self, strategy: mp.ManualParallelStrategy) -> None:
        super().__init__()
        self.emb = shard_embeddings(EmbeddingBagCollection(TABLES), strategy, "auto", SGD(lr=0.1))
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: SparseFeatures, step: int) -> torch.Tensor:
        return self.head(self.emb(batch).values).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def _expected_rates(windows: list[range]) -> list[dict[str, float]]:
    ebc = EmbeddingBagCollection(TABLES)
    assert ebc.raw_id_remap is not None
    out = []
    for window in windows:
        for step in window:
            ebc(_batch(step))
        stats = ebc.raw_id_remap.raw_id_stats(reset=True)
        rates = {}
        for table, counts in stats.items():
            rates[f"raw_ids/{table}/collision_rate"] = counts["collisions"] / counts["ids"]
            rates[f"raw_ids/{table}/eviction_rate"] = counts["evictions"] / counts["ids"]
        ids = sum(c["ids"] for c in stats.values())
        rates["raw_ids/collision_rate"] = sum(c["collisions"] for c in stats.values()) / ids
        rates["raw_ids/eviction_rate"] = sum(c["evictions"] for c in stats.values()) / ids
        out.append(rates)
    return out


def test_trainer_records_collision_and_eviction_rates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    strategy = mp.ManualParallelStrategy()
    trainer = mp.Trainer(strategy, tmp_path, max_steps=4, log_every=2, progress=False)
    last = trainer.fit(_Model(strategy), _batch)
    records = [json.loads(line) for line in trainer.metrics_path.read_text().splitlines()]
    expected = _expected_rates([range(0, 2), range(2, 4)])
    assert [r["step"] for r in records] == [2, 4]
    assert expected[1]["raw_ids/t/eviction_rate"] > 0  # the case exercises evictions
    for record, rates in zip(records, expected, strict=True):
        assert {k: v for k, v in record.items() if k.startswith("raw_ids/")} == rates
    assert {k: v for k, v in last.items() if k.startswith("raw_ids/")} == expected[1]
