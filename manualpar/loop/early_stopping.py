"""EarlyStopping: end fit() when a validation value stops improving.

The Trainer hands it the rank-reduced validation values (identical on every rank), so every rank
takes the same decision at the same step. Its state (the best value, the validations since) is a
checkpoint entry, so a resumed run continues the patience count where the interrupted one was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from manualpar.loop.monitor import Monitor

__all__ = ["EarlyStopping"]

log = logging.getLogger("manualpar.trainer")


class EarlyStopping:
    """Stop after `patience` validations in a row without an improvement of more than
    `min_delta` in `monitor` ("val/<name>"), higher better for mode="max", lower for "min".

        trainer = mp.Trainer(..., val_every=100,
                             early_stopping=mp.EarlyStopping("val/ndcg@10", mode="max"))
    """

    def __init__(
        self, monitor: str, mode: str = "max", patience: int = 10, min_delta: float = 0.0
    ) -> None:
        self._monitor = Monitor("EarlyStopping", monitor, mode)
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping: patience must be an int >= 1, got {patience!r}")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping: min_delta must be >= 0, got {min_delta!r}")
        self.patience, self.min_delta = patience, float(min_delta)
        self.reset()

    @property
    def monitor(self) -> str:
        return self._monitor.monitor

    @property
    def mode(self) -> str:
        return self._monitor.mode

    def reset(self) -> None:
        """Forget every validation seen (a new run)."""
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0  # validations since the best one

    @property
    def should_stop(self) -> bool:
        return self.wait >= self.patience

    def update(self, values: Mapping[str, float], step: int) -> bool:
        """Take one validation pass's reduced values; True when training should stop."""
        value = self._monitor.value_in(values, step)
        if self._monitor.better(value, self.best, self.min_delta):
            self.best, self.best_step, self.wait = value, step, 0
        else:
            self.wait += 1
        return self.should_stop

    def event(self, step: int) -> dict[str, Any]:
        """The metrics.jsonl record of the stop."""
        return {
            "step": step,
            "event": "early_stopping",
            "monitor": self.monitor,
            "best": self.best,
            "best_step": self.best_step,
            "patience": self.patience,
        }

    # ---- checkpoint entry -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "best": self.best,
            "best_step": self.best_step,
            "wait": self.wait,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (state["monitor"], state["mode"]) != (self.monitor, self.mode):
            log.warning(
                "EarlyStopping: the checkpoint's state watched %r (mode=%r), now %r (mode=%r); "
                "the patience count starts afresh",
                state["monitor"],
                state["mode"],
                self.monitor,
                self.mode,
            )
            self.reset()
            return
        self.best, self.best_step, self.wait = state["best"], state["best_step"], state["wait"]
