"""Checkpoint round trips on real processes: sharded 2 -> 2 and 2 -> 1, full export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_models import assert_same, draws, make_model, snapshot, train

import manualpar as mp
from manualpar.testing import run_distributed


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": model,
        "optim": optimizer,
        "step": step,
        "rng": mp.RNGState(),
        "config": {"lr": 0.01, "name": "tiny", "sizes": [4, 8, 2]},
    }


def _save_trained(directory: str) -> dict:
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(7, per_rank=True)
    model = make_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optimizer, steps=3)
    strategy.save_checkpoint(Path(directory) / "step_3", _state(model, optimizer, 3))
    strategy.save_checkpoint(Path(directory) / "full.pt", _state(model, optimizer, 3), full=True)
    result = {"snapshot": snapshot(model, optimizer), "draws": draws()}
    strategy.teardown()
    return result


def _load_fresh(path: str) -> dict:
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(99)
    model = make_model(seed=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    state = _state(model, optimizer, 0)
    state["config"] = None
    loaded = strategy.load_checkpoint(path, state)
    result = {
        "snapshot": snapshot(model, optimizer),
        "draws": draws(),
        "step": loaded["step"],
        "config": loaded["config"],
        "lr": optimizer.param_groups[0]["lr"],
    }
    strategy.teardown()
    return result


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    directory = tmp_path_factory.mktemp("ckpt")
    return directory, run_distributed(_save_trained, world_size=2, args=(str(directory),))


def test_sharded_files_on_disk(saved: tuple[Path, list[dict]]) -> None:
    directory, _ = saved
    checkpoint = directory / "step_3"
    manifest = json.loads((checkpoint / "manualpar.json").read_text())
    assert manifest["kind"] == "sharded"
    assert manifest["world_size"] == 2
    assert manifest["step"] == 3
    assert manifest["entries"] == {
        "model": "module",
        "optim": "optimizer",
        "step": "value",
        "rng": "per_rank",
        "config": "value",
    }
    assert (checkpoint / ".metadata").is_file()
    assert sorted(p.name for p in (checkpoint / "objects").iterdir()) == [
        "rank_0.pt",
        "rank_1.pt",
        "replicated.pt",
    ]
    assert sorted(p.name for p in directory.iterdir()) == ["full.pt", "step_3"]
    assert mp.latest_checkpoint(directory) == checkpoint


def test_round_trip_on_two_ranks(saved: tuple[Path, list[dict]]) -> None:
    directory, before = saved
    after = run_distributed(_load_fresh, world_size=2, args=(str(directory / "step_3"),))
    for rank in range(2):
        assert_same(after[rank]["snapshot"], before[rank]["snapshot"])
        assert after[rank]["draws"] == before[rank]["draws"]  # each rank got its own RNG stream
        assert after[rank]["step"] == 3
        assert after[rank]["config"] == {"lr": 0.01, "name": "tiny", "sizes": [4, 8, 2]}
        assert after[rank]["lr"] == 0.01
    assert before[0]["draws"] != before[1]["draws"]


def test_two_rank_checkpoint_loads_on_one_process(saved: tuple[Path, list[dict]]) -> None:
    directory, before = saved
    after = _load_fresh(str(directory / "step_3"))
    assert_same(after["snapshot"], before[0]["snapshot"])
    assert after["draws"] == before[0]["draws"]
    assert after["step"] == 3


def test_full_export_loads_with_plain_torch(saved: tuple[Path, list[dict]]) -> None:
    directory, before = saved
    blob = torch.load(directory / "full.pt", weights_only=True)
    assert sorted(blob) == ["__manualpar__", "config", "model", "optim", "rng", "step"]
    reference = make_model(seed=5)
    reference.load_state_dict(blob["model"])
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(value, before[0]["snapshot"]["params"][key], rtol=0, atol=0)
    assert sorted(blob["optim"]["state"]) == [
        "model.0.bias",
        "model.0.weight",
        "model.2.bias",
        "model.2.weight",
    ]
    assert sorted(blob["rng"]) == ["rank_0", "rank_1"]
    assert blob["__manualpar__"]["world_size"] == 2
    assert blob["step"] == 3


def test_full_export_loads_back_through_the_strategy(saved: tuple[Path, list[dict]]) -> None:
    directory, before = saved
    after = _load_fresh(str(directory / "full.pt"))
    assert_same(after["snapshot"], before[0]["snapshot"])
    assert after["draws"] == before[0]["draws"]
    assert after["config"]["name"] == "tiny"
