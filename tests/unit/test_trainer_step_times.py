"""Trainer(step_times_every=N): every N-th step's seconds per phase in metrics.jsonl and
TensorBoard, each phase counted once (nested phases are exclusive); off, no record, no
collective, and the collections keep their own recorders."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import manualpar as mp
from manualpar import phase_times
from manualpar.embeddings import SGD, SparseFeatures, shard_embeddings
from manualpar.loop.step_times import PHASES
from manualpar.phase_times import PhaseTimes

TIME_KEYS = {f"time/{name}" for name in (*PHASES, "step")}


class _Tower(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = mp.EmbeddingBagCollection([mp.EmbeddingBagConfig("t", 8, 2)], seed=1)
        self.fc = nn.Linear(2, 1)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.emb = shard_embeddings(self.emb, strategy, "auto", SGD(lr=0.1))

    def training_step(self, batch: SparseFeatures, step: int) -> torch.Tensor:
        return self.fc(self.emb(batch).values).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.dense_parameters(), lr=0.1)


def _batch(step: int, strategy: mp.ManualParallelStrategy) -> SparseFeatures:
    return SparseFeatures.from_dict({"t": [[step % 8], [(step + 3) % 8, 5]]})


def _fit(out: Path, every: int | None, **options: Any) -> tuple[_Tower, list[tuple], dict]:
    """A 6-step fit (checkpoints at 3 and 6); the model, the shapes of the tensors the strategy
    all-reduced, and what fit returned."""
    strategy = mp.ManualParallelStrategy()
    reduced: list[tuple] = []
    all_reduce = strategy.all_reduce

    def spy(value: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        reduced.append(tuple(torch.as_tensor(value).shape))
        return all_reduce(value, *args, **kwargs)

    strategy.all_reduce = spy  # type: ignore[method-assign]
    model = _Tower()
    trainer = mp.Trainer(
        strategy, out, max_steps=6, checkpoint_every=3, log_every=2, progress=False,
        step_times_every=every, **options,
    )  # fmt: skip
    last = trainer.fit(model, _batch)
    return model, reduced, last


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_nth_step_records_each_phase_once_in_metrics_and_tensorboard(
    tmp_path: Path,
) -> None:
    model, reduced, last = _fit(tmp_path, every=3, tensorboard=True)
    timed = [r for r in _records(tmp_path) if "time/step" in r]
    assert [r["step"] for r in timed] == [3, 6]
    for record in timed:
        assert set(record) == {"step", *TIME_KEYS}  # one rank: no time_mean/
        phases = [record[f"time/{name}"] for name in PHASES]
        assert min(phases) >= 0, record
        # exclusive times: together at most the whole step (the rest is the loop's own work)
        assert sum(phases) <= record["time/step"] * (1 + 1e-9), record
        for name in ("checkpoint", "lookup", "dense_forward_backward", "update"):
            assert record[f"time/{name}"] > 0, (name, record)
    assert reduced.count((1, len(PHASES) + 1)) == 2  # one all_reduce per timed step
    assert not any(name.startswith("time") for name in last)  # fit returns the losses
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) >= TIME_KEYS
    assert [e.step for e in events.Scalars("time/lookup")] == [3, 6]
    assert [e.value for e in events.Scalars("time/step")] == pytest.approx(
        [r["time/step"] for r in timed]
    )
    assert model.emb.phase_times.on is False  # its own recorder is back, off


def test_off_records_no_time_and_runs_no_extra_collective(tmp_path: Path) -> None:
    model, reduced, _ = _fit(tmp_path, every=None)
    own = model.emb.phase_times
    assert not any(k.startswith("time") for r in _records(tmp_path) for k in r)
    assert (1, len(PHASES) + 1) not in reduced
    assert model.emb.phase_times is own and not own.seconds  # nothing was timed


@pytest.mark.parametrize("every", [0, -1, 2.5, True])
def test_step_times_every_must_be_a_positive_count(tmp_path: Path, every: Any) -> None:
    with pytest.raises(
        mp.ConfigError, match=r"Trainer: step_times_every must be >= 1 or None, got"
    ):
        mp.Trainer(mp.ManualParallelStrategy(), tmp_path, max_steps=1, step_times_every=every)


def test_a_nested_phase_counts_once_and_off_records_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ticks = iter([0.0, 1.0, 3.0, 10.0, 10.5, 11.0])  # outer, inner 1..3, inner 10..10.5, end
    monkeypatch.setattr(phase_times, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    times = PhaseTimes()
    with times.phase("outer"):  # off: not even the clock is read
        pass
    times.start()
    with times.phase("outer"):
        with times.phase("inner"):
            pass
        with times.phase("inner"):
            pass
    assert times.stop() == {"outer": 11.0 - 2.0 - 0.5, "inner": 2.5}
    with times.phase("outer"):
        pass
    assert times.seconds == {"outer": 8.5, "inner": 2.5}


def test_a_recorder_reads_the_clock_it_is_given() -> None:
    ticks = iter([2.0, 2.25])
    times = PhaseTimes(clock=lambda: next(ticks))  # e.g. time.thread_time
    times.start()
    with times.phase("lookup"):
        pass
    assert times.stop() == {"lookup": 0.25}
