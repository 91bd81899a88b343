"""One protocol for a raw-id remap (manualpar.embeddings.RawIdRemap): both remappers implement
it, the unsharded one's two halves (send, finish) equal one call, and the Trainer's rates read
any remap that implements it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RawIdRemap,
    SparseFeatures,
    shard_embeddings,
)
from manualpar.loop.raw_id_rates import raw_id_rates, raw_id_remappers

TABLES = [EmbeddingBagConfig("t", 8, 2, raw_ids=mp.ManagedCollisions(bucket_rows=4))]


def _batch(seed: int) -> SparseFeatures:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (4, 2), generator=generator) * 1000 - 7
    return SparseFeatures.from_dict({"t": ids.tolist()})


def test_both_remappers_are_the_one_protocol() -> None:
    ebc = EmbeddingBagCollection(TABLES, seed=0)
    emb = shard_embeddings(
        EmbeddingBagCollection(TABLES, seed=0), mp.ManualParallelStrategy(), "auto", SGD(lr=0.1)
    )
    assert isinstance(ebc.raw_id_remap, RawIdRemap)
    assert isinstance(emb.raw_id_remap, RawIdRemap)
    assert not isinstance(ebc, RawIdRemap)  # a collection is not a remap
    remap = ebc.raw_id_remap
    assert not remap.exchanges and remap.owner_remap(["t"]) is None
    remap.refuse()  # no exchange to join: nothing happens


def test_the_unsharded_send_and_finish_equal_one_call() -> None:
    one, two = EmbeddingBagCollection(TABLES, seed=0), EmbeddingBagCollection(TABLES, seed=0)
    assert one.raw_id_remap is not None and two.raw_id_remap is not None
    for seed in range(3):
        batch = _batch(seed)
        sent = two.raw_id_remap.send(batch)
        assert int(two.raw_id_remap.table("t").step) == seed  # nothing remapped yet
        sent.settle()
        assert torch.equal(two.raw_id_remap.finish(sent).values, one.raw_id_remap(batch).values)
    for key, value in one.raw_id_remap.state_dict().items():
        assert torch.equal(two.raw_id_remap.state_dict()[key], value), key
    assert two.raw_id_remap.raw_id_stats() == one.raw_id_remap.raw_id_stats()


class _CountingRemap(nn.Module):
    """A remap of a user's own, fed rows already: counts what the rates read."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"ids": 10, "new": 4, "collisions": 3, "evictions": 1}

    def forward(self, features: SparseFeatures) -> SparseFeatures:
        return features

    def raw_id_stats(self, reset: bool = False) -> dict[str, dict[str, int]]:
        return {"mine": dict(self.counts)}

    @property
    def exchanges(self) -> bool:
        return False

    def send(self, features: SparseFeatures) -> SparseFeatures:
        return features

    def finish(self, sent: SparseFeatures) -> SparseFeatures:
        return sent

    def refuse(self) -> None:
        pass

    def owner_remap(self, names: Sequence[str]) -> None:
        return None


def test_the_trainer_rates_any_raw_id_remap() -> None:
    model = nn.Sequential(nn.Linear(2, 2), _CountingRemap())
    remaps = raw_id_remappers(model)
    assert list(remaps) == ["1"]
    assert raw_id_rates(remaps, mp.ManualParallelStrategy()) == {
        "raw_ids/mine/collision_rate": 0.3,
        "raw_ids/mine/eviction_rate": 0.1,
        "raw_ids/collision_rate": 0.3,
        "raw_ids/eviction_rate": 0.1,
    }
