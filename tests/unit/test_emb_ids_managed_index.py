"""The held-id index of a managed table (kept sorted across steps, rebuilt on outside changes)
finds the same rows as sorting every held id, through evictions, a reset and a load."""

from __future__ import annotations

import pytest
import torch

from manualpar.embeddings import EmbeddingBagConfig, ManagedCollisions
from manualpar.embeddings.ids.buckets import buckets_of
from manualpar.embeddings.ids.managed_collisions import ManagedCollisionTable


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_kept_index_finds_the_rows_sorting_finds(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the index is the torch path's (the C++ remap scans buckets and drops it)
    monkeypatch.setattr(ManagedCollisionTable, "_native_takes", lambda self, ids: False)
    config = EmbeddingBagConfig(
        "t", 1000, 4, raw_ids=ManagedCollisions(policy=policy, bucket_rows=16)
    )
    table = ManagedCollisionTable(config, (10, 40))  # a block of 30 buckets, as on one rank
    generator = torch.Generator().manual_seed(1)
    for step in range(60):
        # a wide id space (many evictions) then a narrow one (mostly held ids)
        high = 3000 if step % 20 < 10 else 300
        distinct, counts = torch.unique(
            torch.randint(-50, high, (60,), generator=generator), return_counts=True
        )
        held_rows = torch.nonzero(table.last_seen).flatten()
        if held_rows.numel():
            probe = torch.unique(torch.cat([distinct, table.ids[held_rows]]))
            found = table._held_rows(probe)
            assert torch.equal(found, table._held_by_sort(probe, held_rows)), step
            assert (found >= 0).sum() == held_rows.numel()
        bucket = buckets_of(distinct, config)
        mine = (bucket >= 10) & (bucket < 40)
        table.remap(distinct[mine], counts[mine])
        if step == 25:
            table.reset_parameters()
        if step == 45:  # a load of a state holding ids this table never indexed
            other = ManagedCollisionTable(config, (10, 40))
            ids = torch.arange(10**6, 10**6 + 3000)
            mine = (buckets_of(ids, config) >= 10) & (buckets_of(ids, config) < 40)
            other.remap(ids[mine], torch.ones_like(ids[mine]))
            table.load_state_dict(other.state_dict())
