"""What a model's configure_optimizers() returns: an optimizer, or a dict with schedulers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["optimizer_and_schedulers"]


def optimizer_and_schedulers(configured: Any, model_name: str) -> tuple[Any, list[Any]]:
    """configure_optimizers() returns an optimizer, or {"optimizer": ..., "schedulers": ...}."""
    if not isinstance(configured, Mapping):
        return configured, []
    unknown = set(configured) - {"optimizer", "schedulers"}
    if "optimizer" not in configured or unknown:
        raise ValueError(
            f"{model_name}.configure_optimizers() returned a dict with keys "
            f"{sorted(configured)}; return an optimizer or "
            "{'optimizer': optimizer, 'schedulers': [scheduler, ...]}"
        )
    schedulers = configured.get("schedulers") or []
    if not isinstance(schedulers, Sequence):
        schedulers = [schedulers]
    return configured["optimizer"], list(schedulers)
