"""A monitored validation value: its name, which direction is better, and the clear error when a
validation pass did not produce it. Shared by EarlyStopping and BestCheckpoints."""

from __future__ import annotations

import math
from collections.abc import Mapping

from manualpar.errors import ConfigError

__all__ = ["MODES", "Monitor"]

MODES = ("max", "min")


class Monitor:
    """`monitor` names a value the Trainer records after a validation pass ("val/<name>");
    `mode` says whether higher ("max") or lower ("min") is better."""

    def __init__(self, owner: str, monitor: str, mode: str) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ConfigError(f"{owner}: monitor must be a non-empty str, got {monitor!r}")
        if mode not in MODES:
            raise ConfigError(
                f"{owner}(monitor={monitor!r}): mode must be one of {MODES}, got {mode!r}"
            )
        self.owner, self.monitor, self.mode = owner, monitor, mode

    def value_in(self, values: Mapping[str, float], step: int) -> float:
        """The monitored value of one pass's reduced values; a ValueError naming what was there
        when it is absent (never silently "no improvement")."""
        if self.monitor in values:
            return float(values[self.monitor])
        hint = ""
        if f"val/{self.monitor}" in values:
            hint = f" (did you mean monitor='val/{self.monitor}'?)"
        raise ConfigError(
            f"{self.owner}(monitor={self.monitor!r}): the validation pass at step {step} "
            f"recorded no such value; it recorded {sorted(values)}{hint}. Monitor one of "
            "these (validation values are recorded as 'val/<name>')"
        )

    def better(self, value: float, than: float | None, min_delta: float = 0.0) -> bool:
        """`value` improves on `than` by more than `min_delta` (NaN never improves)."""
        if math.isnan(value):
            return False
        if than is None or math.isnan(than):
            return True
        if self.mode == "max":
            return value > than + min_delta
        return value < than - min_delta
