"""Trainer(tensorboard=True): every metrics.jsonl record as TensorBoard scalars, read back with
TensorBoard's own event reader; a resumed run appends without repeating steps; a clear error
when tensorboard is missing."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import manualpar as mp


class Crashing(mp.ParallelModule):
    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.crash_at = crash_at

    def training_step(self, batch: torch.Tensor, step: int) -> dict:
        if step == self.crash_at:
            raise RuntimeError(f"injected crash at step {step}")
        out = self.fc(batch)
        return {"loss": out.pow(2).mean(), "mean": out.mean()}

    def validation_step(self, batch: torch.Tensor) -> dict:
        return {"loss": self.fc(batch).pow(2).mean()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def ramp(step: int, strategy: mp.ManualParallelStrategy) -> torch.Tensor:
    return torch.full((4, 2), float(step % 3 + 1))


def fit(out: Path, crash_at: int | None = None) -> None:
    torch.manual_seed(0)
    trainer = mp.Trainer(
        mp.ManualParallelStrategy(), out, max_steps=10, checkpoint_every=4, log_every=1,
        val_every=3, progress=False, tensorboard=True,
    )  # fmt: skip
    trainer.fit(Crashing(crash_at), ramp, val_data=ramp)


def scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def recorded(out: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as {name: [(step, value), ...]}."""
    found: dict[str, list[tuple[int, float]]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for name, value in record.items():
            if name != "step":
                found.setdefault(name, []).append((record["step"], value))
    return found


def assert_same(events: dict, records: dict) -> None:
    assert sorted(events) == sorted(records)
    for tag, points in records.items():
        assert [s for s, _ in events[tag]] == [s for s, _ in points], tag
        # TensorBoard keeps float32
        assert [v for _, v in events[tag]] == pytest.approx([v for _, v in points], rel=1e-6)


def test_every_record_is_a_scalar_at_its_step(tmp_path: Path) -> None:
    fit(tmp_path)
    events, records = scalars(tmp_path), recorded(tmp_path)
    assert sorted(records) == ["loss", "lr", "mean", "steps_per_s", "val/loss"]
    assert_same(events, records)
    assert [s for s, _ in events["loss"]] == list(range(1, 11))
    assert [s for s, _ in events["val/loss"]] == [3, 6, 9]


def test_a_resumed_run_appends_without_repeating_steps(tmp_path: Path) -> None:
    """The crash at step 7 comes after records of steps 5-7 and the validation of step 6; the
    rerun resumes at 4 and redoes them: TensorBoard shows each step once, as metrics.jsonl."""
    with pytest.raises(RuntimeError, match="injected crash at step 7"):
        fit(tmp_path, crash_at=7)
    assert [s for s, _ in scalars(tmp_path)["loss"]] == list(range(1, 8))
    fit(tmp_path)
    events = scalars(tmp_path)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # appended
    assert_same(events, recorded(tmp_path))
    assert [s for s, _ in events["loss"]] == list(range(1, 11))
    assert [s for s, _ in events["val/loss"]] == [3, 6, 9]
    fit(tmp_path / "straight")
    assert_same(events, recorded(tmp_path / "straight") | {"steps_per_s": events["steps_per_s"]})


def test_a_missing_tensorboard_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard fails
    with pytest.raises(ImportError, match=r"pip install 'manualpar\[tensorboard\]'"):
        mp.Trainer(mp.ManualParallelStrategy(), "x", max_steps=1, tensorboard=True)


def test_a_tensorboard_directory_that_cannot_be_written_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file in its place, or a read-only directory, once raised a bare FileExistsError at the
    first record (or nothing until the writer's thread failed); now the Trainer refuses it at
    construction, and a directory broken after that fails the first write naming it."""
    (tmp_path / "tensorboard").write_text("")
    with pytest.raises(
        mp.OutputPathError,
        match=r"^Trainer\(tensorboard=True\): cannot write the TensorBoard log to "
        + re.escape(str(tmp_path / "tensorboard"))
        + r": it is a file, not a directory\. Move it away, pass another out_dir, or pass "
        r"tensorboard=False$",
    ):
        mp.Trainer(mp.ManualParallelStrategy(), tmp_path, max_steps=1, tensorboard=True)
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != read_only and real_access(p, m))
    with pytest.raises(mp.OutputPathError, match=rf"{re.escape(str(read_only))} is not writable"):
        mp.Trainer(mp.ManualParallelStrategy(), read_only / "out", max_steps=1, tensorboard=True)
    monkeypatch.undo()
    later = tmp_path / "later"
    trainer = mp.Trainer(
        mp.ManualParallelStrategy(), later, max_steps=2, log_every=1, progress=False,
        tensorboard=True,
    )  # fmt: skip
    later.mkdir()
    (later / "tensorboard").write_text("")  # replaced by a file after the Trainer was made
    with pytest.raises(mp.OutputPathError, match=r"it is a file, not a directory"):
        trainer.fit(Crashing(), ramp)
