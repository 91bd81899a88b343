"""What a model's configure_optimizers() returns: an optimizer, or a dict with schedulers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from manualpar.errors import ConfigError, ConfigTypeError

__all__ = ["optimizer_and_schedulers", "optimizers_of"]


def optimizers_of(model: Any, optimizer: Any, schedulers: Any) -> tuple[Any, list[Any]]:
    """fit()'s optimizer and schedulers: those passed, else `model.configure_optimizers()`'s."""
    if optimizer is None:
        if not hasattr(model, "configure_optimizers"):
            raise ConfigTypeError(
                f"{type(model).__name__} has no configure_optimizers(); pass optimizer= to fit()"
            )
        optimizer, configured = optimizer_and_schedulers(
            model.configure_optimizers(), type(model).__name__
        )
        schedulers = configured if schedulers is None else schedulers
    if schedulers is None:
        return optimizer, []
    if not isinstance(schedulers, Sequence):
        return optimizer, [schedulers]
    return optimizer, list(schedulers)


def optimizer_and_schedulers(configured: Any, model_name: str) -> tuple[Any, list[Any]]:
    """configure_optimizers() returns an optimizer, or {"optimizer": ..., "schedulers": ...}."""
    if not isinstance(configured, Mapping):
        return configured, []
    unknown = set(configured) - {"optimizer", "schedulers"}
    if "optimizer" not in configured or unknown:
        raise ConfigError(
            f"{model_name}.configure_optimizers() returned a dict with keys "
            f"{sorted(configured)}; return an optimizer or "
            "{'optimizer': optimizer, 'schedulers': [scheduler, ...]}"
        )
    schedulers = configured.get("schedulers") or []
    if not isinstance(schedulers, Sequence):
        schedulers = [schedulers]
    return configured["optimizer"], list(schedulers)
