"""Early stopping, best checkpoints, metric objects and validate() on one process: arguments,
the decisions, what a rerun does, and the errors that name what was wrong."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import manualpar as mp


class Scheduled(mp.ParallelModule):
    """val/score is `scores[k]` at validation pass k; `passes` is a buffer (checkpointed)."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.scores = scores
        self.register_buffer("passes", torch.zeros((), dtype=torch.long))

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        """Nothing to wrap; defined so that setup() marks the model set up."""

    def training_step(self, batch: torch.Tensor, step: int) -> torch.Tensor:
        return self.fc(batch).pow(2).mean()

    def validation_step(self, batch: torch.Tensor) -> dict:
        k = int(self.passes)
        self.passes += 1
        return {"score": self.scores[k], "out": self.fc(batch).mean()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def ramp(step: int, strategy: mp.ManualParallelStrategy) -> torch.Tensor:
    return torch.full((4, 2), float(step % 5 + 1))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def trainer(out: Path, **kwargs: object) -> mp.Trainer:
    settings: dict = {"max_steps": 30, "val_every": 1, "log_every": 1, "progress": False}
    return mp.Trainer(mp.ManualParallelStrategy(), out, **{**settings, **kwargs})  # type: ignore[arg-type]


def test_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(mp.ConfigError, match=r"EarlyStopping\(monitor='val/x'\): mode must be one"):
        mp.EarlyStopping("val/x", mode="up")
    with pytest.raises(mp.ConfigError, match="EarlyStopping: patience must be an int >= 1, got 0"):
        mp.EarlyStopping("val/x", patience=0)
    with pytest.raises(ValueError, match="EarlyStopping: min_delta must be >= 0, got -1"):
        mp.EarlyStopping("val/x", min_delta=-1)
    with pytest.raises(mp.ConfigError, match="BestCheckpoints: keep must be an int >= 1, got 0"):
        mp.BestCheckpoints("val/x", keep=0)
    with pytest.raises(mp.ConfigError, match=r"Trainer\(early_stopping=...\) watches validation"):
        trainer(tmp_path, val_every=None, early_stopping=mp.EarlyStopping("val/x"))
    with pytest.raises(
        mp.ConfigTypeError, match="Trainer: best_checkpoints must be a BestCheckpoints"
    ):
        trainer(tmp_path, best_checkpoints="val/x")


def test_early_stopping_counts_validations_without_an_improvement_beyond_min_delta() -> None:
    stopping = mp.EarlyStopping(
        "val/loss", mode="min", patience=2, min_delta=0.1, check_finite=False
    )
    decisions = [
        stopping.update({"val/loss": value}, step)
        for step, value in enumerate([1.0, 0.95, 0.8, float("nan"), 0.75], start=1)
    ]
    assert decisions == [False, False, False, False, True]  # 0.95 and 0.75: not by > 0.1
    assert (stopping.best, stopping.best_step, stopping.wait) == (0.8, 3, 2)
    again = mp.EarlyStopping("val/loss", mode="min", patience=2, min_delta=0.1, check_finite=False)
    again.load_state_dict(stopping.state_dict())
    assert again.should_stop and again.state_dict() == stopping.state_dict()
    other = mp.EarlyStopping("val/auc", mode="max")
    other.load_state_dict(stopping.state_dict())  # another monitor: starts afresh
    assert (other.best, other.wait) == (None, 0)


def test_a_missing_monitor_names_the_values_that_were_recorded(tmp_path: Path) -> None:
    fit = trainer(tmp_path, early_stopping=mp.EarlyStopping("score"))
    with pytest.raises(
        ValueError,
        match=r"EarlyStopping\(monitor='score'\): the validation pass at step 1 recorded no "
        r"such value; it recorded \['val/out', 'val/score'\] \(did you mean "
        r"monitor='val/score'\?\)",
    ):
        fit.fit(Scheduled([0.5] * 30), ramp, val_data=ramp)
    best = trainer(tmp_path / "b", best_checkpoints=mp.BestCheckpoints("val/ndcg@10"))
    with pytest.raises(mp.ConfigError, match=r"recorded \['val/out', 'val/score'\]. Monitor one"):
        best.fit(Scheduled([0.5] * 30), ramp, val_data=ramp)


def test_early_stopping_stops_at_a_nan_value_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NaN validation value (a diverged model) once counted as one more validation without an
    improvement: the run went on with a NaN model and stopped patience validations later,
    saying nothing. Now it stops at once, with a warning and the event naming value and step."""
    torch.manual_seed(0)
    stopping = mp.EarlyStopping("val/score", "min", patience=10)
    run = trainer(tmp_path, checkpoint_every=100, early_stopping=stopping)
    with caplog.at_level(logging.WARNING, logger="manualpar.trainer"):
        run.fit(Scheduled([0.5, 0.4, float("nan")] + [0.1] * 27), ramp, val_data=ramp)
    assert (run.step, run.stopped_early, stopping.best, stopping.best_step) == (3, True, 0.4, 2)
    assert (
        "early stopping: val/score is nan at step 3 (a diverged model?); every rank stops here "
        "(best 0.4 at step 2). Pass EarlyStopping(check_finite=False) to count it as a "
        "validation without an improvement instead"
    ) in caplog.text
    event = records(tmp_path)[-1]
    assert (event["event"], event["step"], event["best_step"]) == ("early_stopping", 3, 2)
    assert event["reason"] == "non_finite" and math.isnan(event["value"])
    again = mp.EarlyStopping("val/score", "min", patience=10)
    again.load_state_dict(stopping.state_dict())  # a resumed run stays stopped
    assert again.should_stop


SCORES = [0.5, 0.4, 0.45, 0.3, 0.35, 0.36, 0.37, 0.1, 0.2, 0.3] + [0.9] * 20  # mode="min"


def test_an_early_stopped_run_stays_stopped_and_a_larger_patience_goes_on(tmp_path: Path) -> None:
    """min: best 0.3 at step 4; patience 3 stops at step 7. A rerun resumes there and trains
    nothing; with patience 5 it goes on (0.1 at step 8 improves) and stops at step 13."""

    def fit(patience: int) -> tuple[mp.Trainer, dict]:
        torch.manual_seed(0)
        stopping = mp.EarlyStopping("val/score", "min", patience)
        run = trainer(tmp_path, checkpoint_every=100, early_stopping=stopping)
        return run, run.fit(Scheduled(SCORES), ramp, val_data=ramp)

    first, last = fit(3)
    assert (first.step, first.stopped_early, last["val/score"]) == (7, True, 0.37)
    assert records(tmp_path)[-1]["event"] == "early_stopping"
    again, last_again = fit(3)
    assert (again.step, again.stopped_early) == (7, True)
    assert last_again == last  # read back, nothing trained
    longer, _ = fit(5)
    assert (longer.step, longer.stopped_early) == (13, True)
    assert longer.early_stopping is not None and longer.early_stopping.best_step == 8
    assert [r["step"] for r in records(tmp_path) if "val/score" in r] == list(range(1, 14))


def test_best_checkpoints_keep_the_best_and_remove_the_others(tmp_path: Path) -> None:
    torch.manual_seed(0)
    best = mp.BestCheckpoints("val/score", mode="min", keep=2)
    run = trainer(tmp_path, max_steps=10, best_checkpoints=best)
    run.fit(Scheduled(SCORES), ramp, val_data=ramp)
    kept = sorted(p.name for p in (tmp_path / "best").glob("step_*"))
    assert kept == ["step_00000008", "step_00000009"]  # 0.1 and 0.2
    assert (run.best_checkpoint, run.best_score) == (tmp_path / "best" / "step_00000008", 0.1)
    assert mp.read_manifest(run.best_checkpoint)["step"] == 8
    # a new Trainer finds it without training (best/best.json)
    assert trainer(tmp_path).best_checkpoint == tmp_path / "best" / "step_00000008"
    # a rerun removes a best checkpoint its resumed state does not keep (an interrupted run's)
    (tmp_path / "best" / "step_00000011").mkdir()
    trainer(tmp_path, max_steps=10, best_checkpoints=mp.BestCheckpoints("val/score", "min", 2)).fit(
        Scheduled(SCORES), ramp, val_data=ramp
    )
    assert sorted(p.name for p in (tmp_path / "best").glob("step_*")) == kept


class Counter:
    """A metric object: counts the rows it saw (exact over ranks: summed in compute)."""

    def __init__(self) -> None:
        self.rows, self.resets = 0, 0

    def reset(self) -> None:
        self.rows, self.resets = 0, self.resets + 1

    def compute(self, strategy: mp.ManualParallelStrategy) -> dict[str, float]:
        return {"rows": float(strategy.all_reduce(torch.tensor(float(self.rows)), op="sum"))}


class Counted(Scheduled):
    def __init__(self, held: bool = True) -> None:
        super().__init__([0.0] * 30)
        self.counters = {"rows": Counter()} if held else None
        self.loose = Counter()

    def validation_step(self, batch: torch.Tensor) -> dict:
        counter = self.counters["rows"] if self.counters else Counter()
        counter.rows += len(batch)
        return {"rows": counter, "out": self.fc(batch).mean()}


def test_metric_objects_are_reset_before_each_pass_and_computed_after(tmp_path: Path) -> None:
    model = Counted()
    run = trainer(tmp_path, max_steps=3, val_steps=2)
    last = run.fit(model, ramp, val_data=ramp)
    assert last["val/rows"] == 8  # two batches of 4 rows, not 24 (three passes)
    assert [r["val/rows"] for r in records(tmp_path) if "val/rows" in r] == [8, 8, 8]
    assert model.counters is not None and model.counters["rows"].resets == 3
    assert model.loose.resets == 3  # every metric object the model holds is reset


def test_a_metric_object_the_trainer_cannot_reset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        mp.MetricError, match=r"metric object 'rows' \(Counter\), which the Trainer"
    ):
        trainer(tmp_path, max_steps=1).fit(Counted(held=False), ramp, val_data=ramp)


def test_an_edited_or_broken_best_json_is_refused(tmp_path: Path) -> None:
    """best/best.json names the best checkpoint; an edit could point validate(checkpoint="best")
    outside best/, and a broken file raised a bare JSONDecodeError or KeyError."""
    best = tmp_path / "best"
    (tmp_path / "elsewhere").mkdir()
    best.mkdir()
    run = trainer(tmp_path, best_checkpoints=None)
    index = best / "best.json"
    for path in ("../elsewhere", str(tmp_path / "elsewhere"), "step_1/../../elsewhere"):
        index.write_text(json.dumps({"kept": [{"step": 1, "value": 0.5, "path": path}]}))
        with pytest.raises(
            mp.CheckpointError,
            match=rf"^{re.escape(str(index))}: the best checkpoint's path {re.escape(repr(path))} "
            rf"is not a checkpoint inside {re.escape(str(best))}; best.json lists checkpoints of "
            r"best/ by name \(step_<n>\)\. Restore the file or delete it \(and pass the "
            r"checkpoint's path to validate\)$",
        ):
            run.validate(Scheduled(SCORES), ramp, checkpoint="best")
    for garbage in ("{not json", "[]", '{"kept": [{"step": 1}]}', '{"kept": [{"path": 3}]}'):
        index.write_text(garbage)
        broken = rf"^{re.escape(str(index))}: not a best-checkpoint index"
        with pytest.raises(mp.CheckpointError, match=broken):
            run.best_checkpoint  # noqa: B018 (the property reads the file)


def test_validate_outside_fit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    run = trainer(tmp_path, max_steps=4, checkpoint_every=2, keep_last=5, val_every=None,
                  best_checkpoints=None)  # fmt: skip
    with pytest.raises(
        mp.ConfigError, match=r"validate\(checkpoint='latest'\): no checkpoint under"
    ):
        run.validate(Scheduled(SCORES), ramp, checkpoint="latest")
    model = Scheduled(SCORES)
    assert not model.is_setup
    run.validate(model, ramp)  # sets the model up; the current weights at step 0
    assert model.is_setup and model.training
    run.fit(model, ramp)
    current = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = Scheduled(SCORES)
    values = run.validate(fresh, ramp, checkpoint=tmp_path / "checkpoints" / "step_00000002")
    assert set(values) == {"val/score", "val/out"}
    assert values["val/score"] == SCORES[1]  # passes=1 came with the checkpoint's buffers
    assert not torch.equal(fresh.fc.weight, current["fc.weight"])  # the weights of step 2
    latest = run.validate(fresh, ramp, checkpoint="latest")
    assert torch.equal(fresh.fc.weight, current["fc.weight"])
    model.eval()
    again = run.validate(model, ramp)
    assert again["val/out"] == latest["val/out"] and not model.training  # mode kept
    assert [r["step"] for r in records(tmp_path) if "val/out" in r] == [0, 2, 4, 4]
    with pytest.raises(ValueError, match=r"validate\(checkpoint='best'\): no checkpoint under"):
        run.validate(model, ramp, checkpoint="best")
    with pytest.raises(mp.ConfigError, match="no such checkpoint directory"):
        run.validate(model, ramp, checkpoint=tmp_path / "nowhere")
