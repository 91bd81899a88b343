"""EarlyStopping: end fit() when a validation value stops improving.

The Trainer hands it the rank-reduced validation values (identical on every rank), so every rank
takes the same decision at the same step. Its state (the best value, the validations since) is a
checkpoint entry, so a resumed run continues the patience count where the interrupted one was.

A NaN or inf value (a diverged model) stops the run at once by default (`check_finite`): such a
model will not improve, and counting it as one more validation without an improvement would
train on for `patience` validations and then stop as if the model had merely plateaued.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from manualpar.errors import ConfigError
from manualpar.loop.monitor import Monitor

__all__ = ["EarlyStopping"]

log = logging.getLogger("manualpar.trainer")


class EarlyStopping:
    """Stop after `patience` validations in a row without an improvement of more than
    `min_delta` in `monitor` ("val/<name>"), higher better for mode="max", lower for "min".
    A NaN or inf value stops at once (the Trainer logs it, naming the value and step); with
    `check_finite=False` it counts as a validation without an improvement.

        trainer = mp.Trainer(..., val_every=100,
                             early_stopping=mp.EarlyStopping("val/ndcg@10", mode="max"))
    """

    def __init__(
        self,
        monitor: str,
        mode: str = "max",
        patience: int = 10,
        min_delta: float = 0.0,
        check_finite: bool = True,
    ) -> None:
        self._monitor = Monitor("EarlyStopping", monitor, mode)
        if not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"EarlyStopping: patience must be an int >= 1, got {patience!r}")
        if not min_delta >= 0:
            raise ConfigError(f"EarlyStopping: min_delta must be >= 0, got {min_delta!r}")
        self.patience, self.min_delta = patience, float(min_delta)
        self.check_finite = check_finite
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
        self.non_finite: tuple[float, int] | None = None  # (value, step) that stopped the run

    @property
    def should_stop(self) -> bool:
        return self.wait >= self.patience

    def update(self, values: Mapping[str, float], step: int) -> bool:
        """Take one validation pass's reduced values; True when training should stop."""
        value = self._monitor.value_in(values, step)
        if self.check_finite and not math.isfinite(value):
            # stopped for good: should_stop holds, and so does a resume from this state
            self.non_finite, self.wait = (value, step), max(self.wait + 1, self.patience)
            return True
        if self._monitor.better(value, self.best, self.min_delta):
            self.best, self.best_step, self.wait = value, step, 0
        else:
            self.wait += 1
        return self.should_stop

    def event(self, step: int) -> dict[str, Any]:
        """The metrics.jsonl record of the stop (with the value when it was NaN or inf)."""
        reason = {"reason": "non_finite", "value": self.non_finite[0]} if self.non_finite else {}
        return {
            "step": step,
            "event": "early_stopping",
            "monitor": self.monitor,
            "best": self.best,
            "best_step": self.best_step,
            "patience": self.patience,
            **reason,
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
