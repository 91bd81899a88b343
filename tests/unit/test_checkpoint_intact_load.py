"""A load is all or nothing: a checkpoint file cut short or changed after the save is refused,
naming the file and the cause, before anything is copied into the state: dense weights,
optimizer moments, plain values, and a table on the disk tier (its file and its cache)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_models import make_model, train
from torch import nn

import manualpar as mp
import manualpar.checkpoint.load as loading
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.checkpoint.state import flatten
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)

NOTHING_LOADED = "copy this one again; nothing was loaded"


def _dense(seed: int) -> dict[str, Any]:
    model = make_model(seed=seed, hidden=32, layers=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optimizer, steps=1 + seed)
    return {"model": model, "optim": optimizer, "step": 1 + seed}


def _values(state: dict[str, Any]) -> dict[str, Any]:
    """Every value of the state, copied (full tensors for sharded tables)."""
    with full_tensors():
        found: dict[str, Any] = {"step": state["step"]}
        for key in ("model", "optim", "opt"):
            if key in state:
                flat = flatten(state[key].state_dict(), key)
                found.update(
                    {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
                )
    return found


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def _cut(file: Path, fraction: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - max(1, int(len(data) * fraction))])


def _flip_inside(file: Path, tensor: torch.Tensor) -> None:
    """Change one byte of `tensor`'s saved values (not of the archive's padding)."""
    data = bytearray(file.read_bytes())
    at = bytes(data).find(tensor.detach().numpy().tobytes())
    assert at >= 0
    data[at + 5] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda f, saved: _cut(f, 0.001),
            r"__0_0\.distcp is truncated: it holds \d+ bytes, but the checkpoint's metadata "
            r"records \d+ bytes \(optim/state/.+ at bytes \d+-\d+\); the save or a copy of it "
            "was cut short",
        ),
        (  # half the file: the read used to fail with an empty message ("on rank 0: ")
            lambda f, saved: _cut(f, 0.5),
            r"__0_0\.distcp is truncated: it holds \d+ bytes",
        ),
        (
            lambda f, saved: _flip_inside(f, saved["model"][2].weight),
            r"__0_0\.distcp is corrupted: model/2\.weight \(bytes \d+-\d+\) does not read back as "
            r"saved \(Bad CRC-32 for file 'archive/data/0'\); the file changed after the save",
        ),
    ],
    ids=["cut-0.1%", "cut-half", "changed-byte"],
)
def test_a_damaged_shard_is_refused_with_nothing_loaded(
    tmp_path: Path, damage: Any, message: str
) -> None:
    strategy = mp.ManualParallelStrategy()
    saved = _dense(seed=0)
    strategy.save_checkpoint(tmp_path / "c", saved)
    damage(tmp_path / "c" / "__0_0.distcp", saved)
    state = _dense(seed=1)
    before = _values(state)
    with pytest.raises(mp.CheckpointError) as caught:
        strategy.load_checkpoint(tmp_path / "c", state)
    assert re.search(message, str(caught.value)), str(caught.value)
    assert str(caught.value).startswith(f"checkpoint {tmp_path / 'c'}: ")
    assert str(caught.value).endswith(NOTHING_LOADED)
    _assert_same(before, _values(state))


def test_a_damaged_object_file_is_refused_with_nothing_loaded(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    saved = {**_dense(seed=0), "rng": mp.RNGState()}
    strategy.save_checkpoint(tmp_path / "c", saved)
    _cut(tmp_path / "c" / "objects" / "rank_0.pt", 0.01)
    state = {**_dense(seed=1), "rng": mp.RNGState()}
    before = _values(state)
    with pytest.raises(mp.CheckpointError) as caught:
        strategy.load_checkpoint(tmp_path / "c", state)
    assert str(caught.value).startswith(
        f"{tmp_path / 'c' / 'objects' / 'rank_0.pt'} is corrupted or truncated ("
    )
    _assert_same(before, _values(state))


class _Ranker(nn.Module):
    """Dense weights and two tables, one on the disk tier."""

    def __init__(self, tier: Path) -> None:
        super().__init__()
        tables = (EmbeddingBagConfig("big", 500, 4), EmbeddingBagConfig("small", 20, 4))
        plan = EmbeddingPlan(1, {"big": row_wise(on_disk=True), "small": table_wise(0)})
        self.sparse = shard_embeddings(
            EmbeddingBagCollection(tables, seed=1),
            mp.ManualParallelStrategy(),
            plan,
            RowWiseAdagrad(lr=0.1),
            disk_tier=DiskTier(tier, cache_rows=16),
        )
        self.top = nn.Linear(8, 1)

    def forward(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(step)
        ids = torch.cat([torch.randint(0, 500, (12,), generator=generator), torch.arange(8)])
        features = SparseFeatures(["big", "small"], ids, torch.tensor([3] * 4 + [2] * 4))
        return self.top(self.sparse(features).values).square().mean()


def test_a_damaged_shard_leaves_a_disk_table_untouched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Ranker(tmp_path / "tier")
    optimizer = torch.optim.Adam(model.top.parameters(), lr=0.01)

    def steps(first: int, count: int) -> None:
        for step in range(first, first + count):
            optimizer.zero_grad()
            model(step).backward()
            optimizer.step()

    state = {"model": model, "optim": optimizer, "opt": model.sparse.fused_optimizer, "step": 0}
    strategy = mp.ManualParallelStrategy()
    steps(0, 3)
    strategy.save_checkpoint(tmp_path / "c", state)
    steps(3, 3)  # the tables, their cache and the moments move on from the checkpoint
    state["step"] = 6
    before = _values(state)
    with torch.no_grad():
        loss_before = model(99)
    _cut(next((tmp_path / "c").glob("*.distcp")), 0.001)
    with pytest.raises(mp.CheckpointError, match=r"__0_0\.distcp is truncated"):
        strategy.load_checkpoint(tmp_path / "c", state)
    _assert_same(before, _values(state))
    with torch.no_grad():  # what the tier serves (file and cache) is unchanged too
        assert torch.equal(model(99), loss_before)


def test_a_file_that_changes_after_the_check_is_named_and_said_partly_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read itself names the file, byte range and cause (a read past the end of a cut file
    has no message of its own), and says the state may be partly loaded."""
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "c", _dense(seed=0))
    _cut(tmp_path / "c" / "__0_0.distcp", 0.5)  # as if cut between the check and the read
    monkeypatch.setattr(loading, "check_tensor_files", lambda *args: None)
    with pytest.raises(mp.CheckpointError) as caught:
        strategy.load_checkpoint(tmp_path / "c", _dense(seed=1))
    assert re.fullmatch(
        rf"load_checkpoint\({re.escape(str(tmp_path / 'c'))}\): reading tensor shards failed on "
        r"rank 0: __0_0\.distcp \(bytes \d+-\d+\): EOFError \(no message\)\. The files "
        "passed the check before this read, so one changed or could not be read during it: "
        "the state may be partly loaded; load a checkpoint again before training",
        str(caught.value),
    ), str(caught.value)


def test_a_sizes_only_load_still_refuses_a_cut_shard_and_loads_a_changed_byte(
    tmp_path: Path,
) -> None:
    """verify="sizes": what it still catches (a shard cut short, nothing loaded) and what it
    leaves to the storage (a changed byte is loaded as it is)."""
    strategy = mp.ManualParallelStrategy()
    saved = _dense(seed=0)
    strategy.save_checkpoint(tmp_path / "c", saved)
    strategy.save_checkpoint(tmp_path / "d", saved)
    _cut(tmp_path / "c" / "__0_0.distcp", 0.001)
    _flip_inside(tmp_path / "d" / "__0_0.distcp", saved["model"][2].weight)
    state = _dense(seed=1)
    before = _values(state)
    with pytest.raises(mp.CheckpointError, match=r"__0_0\.distcp is truncated: it holds"):
        strategy.load_checkpoint(tmp_path / "c", state, verify="sizes")
    _assert_same(before, _values(state))
    strategy.load_checkpoint(tmp_path / "d", state, verify="sizes")
    changed = state["model"][2].weight != saved["model"][2].weight
    assert int(changed.sum()) == 1  # the one changed value, loaded


def test_an_unknown_verify_value_is_refused_with_nothing_loaded(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "c", _dense(seed=0))
    state = _dense(seed=1)
    before = _values(state)
    with pytest.raises(
        mp.ConfigError, match=r"load_checkpoint\(verify='none'\): pass one of crc, sizes"
    ):
        strategy.load_checkpoint(tmp_path / "c", state, verify="none")
    _assert_same(before, _values(state))
