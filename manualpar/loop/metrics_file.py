"""metrics.jsonl: one JSON record a line, written by rank 0; what a resumed or finished run
reads back from it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from manualpar.strategy import ManualParallelStrategy

__all__ = ["MetricsFile"]


class MetricsFile:
    def __init__(self, path: Path, strategy: ManualParallelStrategy) -> None:
        self.path, self.strategy = path, strategy

    def append(self, record: Mapping[str, Any]) -> None:
        if self.strategy.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")

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
        losses and validation values, without step, learning rates or throughput; on every
        rank (one broadcast)."""
        found: dict[str, float] = {}
        if self.strategy.is_global_zero and self.path.exists():
            for line in self.path.read_text().splitlines():
                record = json.loads(line) if line else {}
                if record.get("step") == step and "event" not in record:
                    found.update(record)
        found = self.strategy.broadcast(found)  # rank 0 holds the file
        skipped = {"step", "lr", "steps_per_s"}
        return {k: v for k, v in found.items() if k not in skipped and not k.endswith("/lr")}
