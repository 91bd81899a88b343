"""The Trainer resumes from the newest checkpoint that loads: a damaged latest one is skipped
(a warning and a metrics.jsonl event), a mismatch still stops the run, and a checkpoint whose
manifest cannot be read never stops a run (resume and prune keep it, naming it). validate and
predict with checkpoint="latest" follow the same rules."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import manualpar as mp


class _Regression(mp.ParallelModule):
    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 1)

    def training_step(self, batch: torch.Tensor, step: int) -> torch.Tensor:
        return self.fc(batch[:, : self.fc.in_features]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def validation_step(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.fc(batch[:, : self.fc.in_features]).mean()}

    def predict_step(self, batch: torch.Tensor) -> torch.Tensor:
        return self.fc(batch[:, : self.fc.in_features])


def _ramp(step: int, strategy: mp.ManualParallelStrategy) -> torch.Tensor:
    return torch.full((4, 3), float(step + 1)) / (step + 2)


def _trainer(out_dir: Path, max_steps: int) -> mp.Trainer:
    return mp.Trainer(
        mp.ManualParallelStrategy(),
        out_dir,
        max_steps=max_steps,
        checkpoint_every=2,
        keep_last=2,
        log_every=1,
        progress=False,
    )


def _fit(out_dir: Path, max_steps: int, width: int = 2) -> _Regression:
    torch.manual_seed(0)
    model = _Regression(width)
    _trainer(out_dir, max_steps).fit(model, _ramp)
    return model


def _cut_in_half(checkpoint: Path, keep: int | None = None) -> None:
    """`keep` bytes of the shard (default half: the model's entries come first and stay whole)."""
    shard = checkpoint / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2 if keep is None else keep])


def _events(out_dir: Path) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "event" in record]


def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    straight = _fit(tmp_path / "straight", 6)
    _fit(tmp_path / "run", 4)
    checkpoints = tmp_path / "run" / "checkpoints"
    _cut_in_half(checkpoints / "step_00000004")
    with caplog.at_level(logging.WARNING, logger="manualpar.trainer"):
        resumed = _fit(tmp_path / "run", 6)
    assert (
        f"skipping checkpoint {checkpoints / 'step_00000004'}: it cannot be loaded (checkpoint "
        f"{checkpoints / 'step_00000004'}: __0_0.distcp is truncated: it holds"
    ) in caplog.text
    (event,) = _events(tmp_path / "run")
    assert event["step"] == 2 and event["event"] == "checkpoint_skipped"
    assert event["checkpoint"] == str(checkpoints / "step_00000004")
    assert event["resumed_from"] == str(checkpoints / "step_00000002")
    assert "__0_0.distcp is truncated" in event["reason"]
    for got, want in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(got, want)  # steps 3 and 4 redone from step 2: the same run
    assert mp.read_manifest(mp.latest_checkpoint(checkpoints))["step"] == 6


def test_no_checkpoint_that_loads_or_a_mismatch_stops_the_run(tmp_path: Path) -> None:
    _fit(tmp_path, 4)
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(mp.CheckpointMismatchError, match="does not match the state"):
        _fit(tmp_path, 6, width=3)  # another model: an older checkpoint would not match either
    for name in ("step_00000002", "step_00000004"):
        _cut_in_half(checkpoints / name)
    with pytest.raises(mp.CheckpointError) as caught:
        _fit(tmp_path, 6)
    message = str(caught.value)
    assert message.startswith(
        f"cannot resume: none of the checkpoints in {checkpoints} can be read"
    )
    assert "step_00000004: checkpoint" in message and "step_00000002: checkpoint" in message
    assert message.endswith("Restore an intact copy, or move them away to start afresh")


@pytest.mark.parametrize(
    "manifest",
    ["{not json", "[1, 2]", '{"format": "manualpar-checkpoint"}'],
    ids=["not-json", "not-a-mapping", "no-step"],
)
def test_an_unreadable_older_manifest_never_stops_a_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, manifest: str
) -> None:
    _fit(tmp_path, 2)
    odd = tmp_path / "checkpoints" / "step_00000000"
    odd.mkdir()
    (odd / "manualpar.json").write_text(manifest)
    with caplog.at_level(logging.WARNING, logger="manualpar.trainer"):
        _fit(tmp_path, 6)  # resumes at 2, saves at 4 and 6 and prunes after each save
    assert sorted(p.name for p in odd.parent.iterdir()) == [
        "step_00000000",  # kept: which run or step it holds is unknown
        "step_00000004",
        "step_00000006",
    ]
    assert f"keeping {odd}, which prune cannot date: " in caplog.text


def test_validate_latest_skips_a_damaged_checkpoint_as_resume_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _fit(tmp_path, 4)
    checkpoints = tmp_path / "checkpoints"
    wanted = _Regression()
    strategy = mp.ManualParallelStrategy()
    strategy.load_checkpoint(checkpoints / "step_00000002", {"model": wanted})
    _cut_in_half(checkpoints / "step_00000004", keep=16)
    model = _Regression()
    with caplog.at_level(logging.WARNING, logger="manualpar.trainer"):
        values = _trainer(tmp_path, 4).validate(model, _ramp, checkpoint="latest")
    assert (
        f"skipping checkpoint {checkpoints / 'step_00000004'}: it cannot be loaded (checkpoint "
        f"{checkpoints / 'step_00000004'}: __0_0.distcp is truncated"
    ) in caplog.text
    for got, want in zip(model.parameters(), wanted.parameters(), strict=True):
        assert torch.equal(got, want)  # the weights of step 2
    (event,) = _events(tmp_path)
    assert event["step"] == 2 and event["event"] == "checkpoint_skipped"
    assert event["resumed_from"] == str(checkpoints / "step_00000002")
    records = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(records[-1]) == {"step": 2, "val/out": values["val/out"]}
    predicted = _Regression()
    batches = _trainer(tmp_path, 4).predict(predicted, _ramp, steps=1, checkpoint="latest")
    assert torch.equal(next(iter(batches)), wanted.fc(_ramp(0, strategy)[:, :2]))


def test_validate_latest_with_no_checkpoint_that_loads_or_a_mismatch_raises(
    tmp_path: Path,
) -> None:
    _fit(tmp_path, 4)
    checkpoints = tmp_path / "checkpoints"
    run = _trainer(tmp_path, 4)
    with pytest.raises(mp.CheckpointMismatchError, match="does not match the state"):
        run.validate(_Regression(width=3), _ramp, checkpoint="latest")  # never skipped
    for name in ("step_00000002", "step_00000004"):
        _cut_in_half(checkpoints / name, keep=16)
    for call in (run.validate, run.predict):
        with pytest.raises(mp.CheckpointError) as caught:
            call(_Regression(), _ramp, checkpoint="latest")
        message = str(caught.value)
        assert message.startswith(
            f"cannot load Trainer.{call.__name__}(checkpoint='latest'): none of the checkpoints "
            f"in {checkpoints} can be read"
        )
        assert "step_00000004: checkpoint" in message and "step_00000002: checkpoint" in message
        assert message.endswith(
            "Restore an intact copy, or pass the path of a checkpoint that loads"
        )
