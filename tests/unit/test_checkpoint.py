"""Checkpoints on one process: errors (mismatches, corruption, misuse), latest, overwrite.

Round trips through 2 real ranks are in tests/dist/test_checkpoint_two_ranks.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_models import make_model, train

import manualpar as mp


def _trained_state(hidden: int = 8, layers: int = 2) -> dict:
    model = make_model(seed=0, hidden=hidden, layers=layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optimizer, steps=1)
    return {"model": model, "optim": optimizer, "step": 1}


def test_other_shapes_raise_listing_them(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "a", _trained_state(hidden=8))
    other = _trained_state(hidden=16)
    before = other["model"][0].weight.detach().clone()
    with pytest.raises(
        mp.CheckpointMismatchError,
        match=r"model/0\.weight: checkpoint \(8, 4\) vs current \(16, 4\)",
    ):
        strategy.load_checkpoint(tmp_path / "a", other)
    assert torch.equal(other["model"][0].weight, before), "nothing is modified on mismatch"


def test_missing_and_unexpected_keys_are_listed(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "shallow", _trained_state(layers=2))
    strategy.save_checkpoint(tmp_path / "deep", _trained_state(layers=3))
    with pytest.raises(mp.CheckpointMismatchError) as caught:
        strategy.load_checkpoint(tmp_path / "shallow", {"model": make_model(0, layers=3)})
    message = str(caught.value)
    assert "missing from the checkpoint: model/4.bias, model/4.weight" in message
    assert "model/2.weight: checkpoint (2, 8) vs current (8, 8)" in message
    with pytest.raises(mp.CheckpointMismatchError) as caught:
        strategy.load_checkpoint(tmp_path / "deep", {"model": make_model(0, layers=2), "epoch": 0})
    message = str(caught.value)
    assert "unexpected in the checkpoint: model/4.bias, model/4.weight" in message
    assert "missing from the checkpoint: epoch" in message


def test_loading_only_the_model_from_a_training_checkpoint(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    saved = _trained_state()
    strategy.save_checkpoint(tmp_path / "a", saved)
    model = make_model(seed=4)
    strategy.load_checkpoint(tmp_path / "a", {"model": model})  # strict; optim/step not asked for
    assert torch.equal(model[0].weight, saved["model"][0].weight)


def test_non_strict_loads_the_matching_entries(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    saved = _trained_state()
    strategy.save_checkpoint(tmp_path / "a", saved)
    fresh = {"model": make_model(seed=3), "step": 0, "extra": "kept"}
    strategy.load_checkpoint(tmp_path / "a", fresh, strict=False)
    assert fresh["step"] == 1
    assert fresh["extra"] == "kept"
    assert torch.equal(fresh["model"][0].weight, saved["model"][0].weight)


def test_not_a_checkpoint_and_partial_and_missing(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        mp.CheckpointError,
        match="is not a complete manualpar checkpoint: it is not a checkpoint directory",
    ):
        strategy.load_checkpoint(tmp_path / "empty", {"step": 0})
    with pytest.raises(mp.CheckpointError, match="no checkpoint at"):
        strategy.load_checkpoint(tmp_path / "nowhere", {"step": 0})
    (tmp_path / ".step_9.partial").mkdir()
    with pytest.raises(mp.CheckpointError, match="is a partial checkpoint that was never"):
        strategy.load_checkpoint(tmp_path / ".step_9.partial", {"step": 0})


def test_truncated_full_checkpoint(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "full.pt", _trained_state(), full=True)
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "full.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(mp.CheckpointError, match="is corrupted, truncated or not a checkpoint"):
        strategy.load_checkpoint(tmp_path / "full.pt", _trained_state())


def test_latest_checkpoint_orders_by_step_and_skips_partials(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    assert mp.latest_checkpoint(tmp_path / "none-yet") is None
    for step in (2, 10, 5):
        strategy.save_checkpoint(tmp_path / f"step_{step}", {"step": step})
    (tmp_path / ".step_20.partial").mkdir()
    (tmp_path / "step_30").mkdir()  # no manifest: never committed
    assert mp.latest_checkpoint(tmp_path) == tmp_path / "step_10"


def test_overwrite_replaces_and_refuses_when_asked(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "c", {"step": 1})
    strategy.save_checkpoint(tmp_path / "c", {"step": 2})
    assert strategy.load_checkpoint(tmp_path / "c", {"step": 0})["step"] == 2
    with pytest.raises(mp.CheckpointError, match="already exists; pass overwrite=True"):
        strategy.save_checkpoint(tmp_path / "c", {"step": 3}, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_unsafe_values_are_refused_at_save(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()

    class Opaque:
        pass

    with pytest.raises(mp.CheckpointError, match="cannot be loaded back safely"):
        strategy.save_checkpoint(tmp_path / "c", {"thing": Opaque()})
    assert not (tmp_path / "c").exists()


def test_optimizer_over_a_module_not_in_the_state(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    model = make_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        mp.CheckpointError,
        match=r"optimizer 'optim' holds a parameter of shape "
        r"\(8, 4\) that belongs to no module",
    ):
        strategy.save_checkpoint(tmp_path / "c", {"optim": optimizer})


def test_bad_state_keys(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    with pytest.raises(mp.CheckpointError, match=r"key 'a/b' must be a non-empty string"):
        strategy.save_checkpoint(tmp_path / "c", {"a/b": 1})


def test_full_export_respects_overwrite(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "full.pt", {"step": 1}, full=True)
    with pytest.raises(mp.CheckpointError, match="already exists; pass overwrite=True"):
        strategy.save_checkpoint(tmp_path / "full.pt", {"step": 2}, full=True, overwrite=False)
    assert torch.load(tmp_path / "full.pt", weights_only=True)["step"] == 1


def test_corrupted_tensor_shards_and_manifest(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "c", _trained_state())
    shard = next((tmp_path / "c").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(mp.CheckpointError, match=r"__0_0\.distcp is truncated: it holds 100 bytes"):
        strategy.load_checkpoint(tmp_path / "c", _trained_state())
    (tmp_path / "c" / "manualpar.json").write_text("{not json")
    with pytest.raises(mp.CheckpointError, match=r"manualpar\.json is unreadable or corrupted"):
        strategy.load_checkpoint(tmp_path / "c", _trained_state())
    (tmp_path / "c" / ".metadata").write_bytes(b"garbage")
    (tmp_path / "c" / "manualpar.json").write_text(
        json.dumps({"format": "manualpar-checkpoint", "kind": "sharded"})
    )
    with pytest.raises(mp.CheckpointError, match="is corrupted or truncated"):
        strategy.load_checkpoint(tmp_path / "c", _trained_state())
