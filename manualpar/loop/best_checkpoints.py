"""BestCheckpoints: keep the checkpoints of the best validation values, apart from the rolling
ones.

They live in `<out_dir>/best/step_<n>/` (full training state, the same format as
`checkpoints/`), so a resume still starts from the latest rolling checkpoint. Which ones are
kept is itself a checkpoint entry (exact after a resume); `best/best.json` (rank 0, replaced
atomically) lists them best first, so a new Trainer finds the best one without training.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from manualpar.errors import CheckpointError, ConfigError
from manualpar.loop.monitor import Monitor

__all__ = ["BestCheckpoints", "read_best_index"]

INDEX = "best.json"


class BestCheckpoints:
    """Save a checkpoint whenever `monitor` ("val/<name>") ranks among the `keep` best values
    seen (higher better for mode="max", lower for "min"); delete the one that drops out.

        trainer = mp.Trainer(..., best_checkpoints=mp.BestCheckpoints("val/auc", keep=3))
        trainer.fit(model, data, val_data=val)
        trainer.best_checkpoint, trainer.best_score      # path (or None) and its value
    """

    def __init__(self, monitor: str, mode: str = "max", keep: int = 1) -> None:
        self._monitor = Monitor("BestCheckpoints", monitor, mode)
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"BestCheckpoints: keep must be an int >= 1, got {keep!r}")
        self.keep = keep
        self.directory: Path | None = None  # set by the Trainer: <out_dir>/best
        self.kept: list[tuple[float, int]] = []  # (value, step), best first

    @property
    def monitor(self) -> str:
        return self._monitor.monitor

    @property
    def mode(self) -> str:
        return self._monitor.mode

    def reset(self) -> None:
        self.kept = []

    def path(self, step: int) -> Path:
        if self.directory is None:
            raise ConfigError("BestCheckpoints: pass it to a Trainer (best_checkpoints=...)")
        return self.directory / f"step_{step:08d}"

    @property
    def best(self) -> tuple[float, Path] | None:
        """(value, path) of the best kept checkpoint, or None before any."""
        return (self.kept[0][0], self.path(self.kept[0][1])) if self.kept else None

    def consider(self, values: Mapping[str, float], step: int) -> Path | None:
        """The directory to save step's checkpoint into when its value ranks among the `keep`
        best (it is then counted as kept), else None. The same on every rank."""
        value = self._monitor.value_in(values, step)
        worst = self.kept[-1][0] if len(self.kept) >= self.keep else None
        if not self._monitor.better(value, worst):  # NaN never ranks
            return None
        self.kept = [entry for entry in self.kept if entry[1] != step]
        self.kept.append((value, step))
        # stable: among equal values the earlier checkpoint stays ahead
        self.kept.sort(key=lambda entry: -entry[0] if self.mode == "max" else entry[0])
        self.kept = self.kept[: self.keep]
        return self.path(step)

    def prune(self) -> None:
        """Delete every best/step_<n> not kept and rewrite best.json; rank 0 only (it also
        removes what an interrupted run saved after the checkpoint a resume started from)."""
        if self.directory is None or not self.directory.is_dir():
            return
        kept = {self.path(step).name for _, step in self.kept}
        for entry in self.directory.iterdir():
            stale = entry.name.lstrip(".").startswith("step_") and entry.name not in kept
            if stale and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
        index = [
            {"step": step, "value": value, "path": self.path(step).name}
            for value, step in self.kept
        ]
        record = {"monitor": self.monitor, "mode": self.mode, "kept": index}
        staging = self.directory / f".{INDEX}.partial"
        staging.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(staging, self.directory / INDEX)

    # ---- checkpoint entry -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "kept": [[value, step] for value, step in self.kept],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        same = (state["monitor"], state["mode"]) == (self.monitor, self.mode)
        kept = [(float(v), int(s)) for v, s in state["kept"]] if same else []
        self.kept = kept[: self.keep]


def read_best_index(directory: Path) -> tuple[float, Path] | None:
    """(value, path) of the best checkpoint listed in `directory/best.json`, or None.

    The file is checked before it is used (an edited or broken one raises CheckpointError
    naming it): its paths must name checkpoints inside `directory`, as `prune` writes them, so
    that validate(checkpoint="best") never loads from anywhere else."""
    index = directory / INDEX
    if not index.is_file():
        return None
    kept = _kept(index)
    for _, name in kept:
        if not _names_a_child(directory, name):
            raise CheckpointError(
                f"{index}: the best checkpoint's path {name!r} is not a checkpoint inside "
                f"{directory}; best.json lists checkpoints of best/ by name (step_<n>). Restore "
                "the file or delete it (and pass the checkpoint's path to validate)"
            )
    return (kept[0][0], directory / kept[0][1]) if kept else None


def _kept(index: Path) -> list[tuple[float, str]]:
    """The (value, path) entries of a best.json, best first; CheckpointError if it is not one."""
    try:
        kept = json.loads(index.read_text())["kept"]
        entries = [(float(entry["value"]), entry["path"]) for entry in kept]
        if not all(isinstance(name, str) for _, name in entries):
            raise TypeError("a path that is not a string")
    except (ValueError, TypeError, KeyError, IndexError) as error:  # JSONDecodeError: a ValueError
        raise CheckpointError(
            f"{index}: not a best-checkpoint index ({type(error).__name__}: {error}); "
            'BestCheckpoints writes {"monitor": ..., "mode": ..., "kept": [{"step": ..., '
            '"value": ..., "path": "step_<n>"}, ...]}. Restore the file or delete it (the '
            "next run that keeps a best checkpoint writes it again)"
        ) from None
    return entries


def _names_a_child(directory: Path, name: str) -> bool:
    """`name` is one entry of `directory` (no separator, no "..", no link leading out)."""
    if name in ("", ".", "..") or Path(name).name != name:
        return False
    return (directory / name).resolve().parent == directory.resolve()
