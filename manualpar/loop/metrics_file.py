"""metrics.jsonl: one JSON record a line, written by rank 0; what a resumed or finished run
reads back from it; the window of training values averaged into a record, and the mean over
ranks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from manualpar.strategy import ManualParallelStrategy

__all__ = ["MetricsFile", "Window", "mean_over_ranks"]

_TIMES = ("time/", "time_mean/")  # step_times.py's records: not values fit() returns


class MetricsFile:
    def __init__(self, path: Path, strategy: ManualParallelStrategy) -> None:
        self.path, self.strategy = path, strategy
        # called with every record appended (rank 0): the TensorBoard log
        self.listeners: list[Callable[[Mapping[str, Any]], None]] = []

    def append(self, record: Mapping[str, Any]) -> None:
        if self.strategy.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            for listener in self.listeners:
                listener(record)

    def keep_until(self, step: int) -> None:
        """Drop what an interrupted run recorded after `step` (its last checkpoint): it is
        redone. Rank 0 only (it holds the file)."""
        if self.strategy.is_global_zero and self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line and json.loads(line)["step"] <= step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))

    def recorded_at(self, step: int) -> dict[str, float]:
        """The metrics recorded at `step` (a finished run's last ones), as fit() returns them:
        losses and validation values, without step, learning rates, throughput or step
        times; on every rank (one broadcast)."""
        found: dict[str, float] = {}
        if self.strategy.is_global_zero and self.path.exists():
            for line in self.path.read_text().splitlines():
                record = json.loads(line) if line else {}
                if record.get("step") == step and "event" not in record:
                    found.update(record)
        found = self.strategy.broadcast(found)  # rank 0 holds the file
        skipped = {"step", "lr", "steps_per_s"}
        return {
            k: v
            for k, v in found.items()
            if k not in skipped and not k.endswith("/lr") and not k.startswith(_TIMES)
        }


@dataclass
class Window:
    """The training values of the steps since the last record, averaged into the next one."""

    values: dict[str, list[float]] = field(default_factory=dict)
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.values.setdefault(name, []).append(value)
        self.steps += 1

    def means(self) -> dict[str, float]:
        return {name: sum(v) / len(v) for name, v in self.values.items()}

    def rate(self) -> float:
        """Steps per second since the window opened."""
        return self.steps / (time.perf_counter() - self.started)


def mean_over_ranks(
    strategy: ManualParallelStrategy, values: Mapping[str, float]
) -> dict[str, float]:
    """Each value's mean over ranks, in one collective for all names."""
    if not values:
        return {}
    names = sorted(values)
    tensor = torch.tensor([values[n] for n in names], dtype=torch.float64)
    means = strategy.all_reduce(tensor, op="mean").tolist()
    return dict(zip(names, means, strict=True))
