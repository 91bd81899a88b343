"""Optimizer state on fresh memory: a large zeroed block takes memory only where an update
writes it (no pass writes its zeros at init), and trains bit-exactly as a zero-filled one."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import manualpar as mp
from manualpar.embeddings import (
    Adam,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    SparseFeatures,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.kernels import row_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="fresh mappings are made on Linux only"
)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_zeroed_block_takes_memory_only_where_written():
    before = _resident_bytes()
    block = row_memory.zeros_rows(262_144, 64)  # 64 MiB
    assert _resident_bytes() - before < 8 * 2**20  # zero-filled: all 64 MiB resident
    block[1000] = 2.0
    assert _resident_bytes() - before < 16 * 2**20  # the written page only
    assert block.sum().item() == 128.0 and bool(block[1000].eq(2.0).all())
    assert block.shape == (262_144, 64) and block.dtype == torch.float32


def _train_adam() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Three Adam steps on a 16384 x 64 table (each moment 4 MiB: a fresh mapping)."""
    config = EmbeddingBagConfig("t", 16_384, 64, feature_names=("f",))
    with mp.empty_init():
        ebc = EmbeddingBagCollection([config], seed=3)
    plan = {"t": table_wise(0)}
    emb = shard_embeddings(ebc, mp.ManualParallelStrategy(), plan, Adam(lr=0.1))
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(0, 16_384, (256,), generator=generator)
        emb(SparseFeatures(("f",), ids, torch.full((64,), 4))).values.square().sum().backward()
    state = emb.fused_optimizer.table_state["t"]
    return emb.tables["t"].weight.detach().clone(), {k: v.clone() for k, v in state.items()}


def test_adam_state_on_fresh_memory_trains_as_a_zero_filled_state(monkeypatch):
    weight, state = _train_adam()
    monkeypatch.setattr(
        row_memory, "_fresh_zeros", lambda shape, dtype: torch.zeros(shape, dtype=dtype)
    )
    zero_filled_weight, zero_filled_state = _train_adam()
    assert torch.equal(weight, zero_filled_weight)
    assert state.keys() == zero_filled_state.keys() and len(state) == 2
    for key, value in state.items():
        assert torch.equal(value, zero_filled_state[key]), key


def test_a_table_block_and_its_state_are_packed_on_advised_2_mib_aligned_memory(monkeypatch):
    advised = []
    monkeypatch.setattr(row_memory, "_madvise_range", lambda *span: advised.append(span) or True)
    monkeypatch.setattr(row_memory, "_current", None)
    weight = row_memory.empty_rows(200_000, 16)  # 12.8 MB: not a whole number of huge pages
    state = row_memory.zeros_rows(200_000)  # 800 KB: too small to be advised on its own
    ((start, length),) = advised
    assert start % row_memory.HUGE_PAGE == 0 and length % row_memory.HUGE_PAGE == 0
    for block in (weight, state):  # no head or tail outside the advised huge pages
        first = block.data_ptr()
        assert start <= first and first + block.numel() * block.element_size() <= start + length
    assert state.data_ptr() >= weight.data_ptr() + 12_800_000 and not state.any()
    row_memory.empty_rows(10, 4)  # small: on the heap, nothing more advised
    assert len(advised) == 1
    mapping = row_memory._current
    assert mapping is not None
    del weight, state, block
    assert mapping() is None  # unmapped with the last block carved from it


def _mapping_resident_bytes(address: int) -> int:
    """Rss of the mapping holding `address`, from /proc/self/smaps."""
    with open("/proc/self/smaps") as handle:
        inside = False
        for line in handle:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the block")


def test_a_freed_block_returns_its_pages_while_its_siblings_live(monkeypatch):
    monkeypatch.setattr(row_memory, "_current", None)
    before = row_memory.empty_rows(300_000)  # 1.2 MB, then 8 MB, then 1.2 MB: one mapping
    freed = row_memory.empty_rows(2**21)
    after = row_memory.empty_rows(300_000)
    for value, block in enumerate((before, freed, after), 1):
        block.fill_(value)
    resident = _mapping_resident_bytes(before.data_ptr())
    assert resident >= 10 * 2**20
    del freed, block
    # the 8 MB block's whole 2 MiB pages went back; the two a live neighbour shares stayed whole
    kept = _mapping_resident_bytes(before.data_ptr())
    assert kept <= resident - 4 * 2**20
    assert bool(before.eq(1).all()) and bool(after.eq(3).all())  # neighbours untouched
    del before  # the gap now reaches the mapping's start: the page it shared goes too
    assert _mapping_resident_bytes(after.data_ptr()) <= kept - 2**20
    assert bool(after.eq(3).all())
