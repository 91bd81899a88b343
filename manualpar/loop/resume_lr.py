"""What a resume does to learning rates: the checkpoint's replace the configured ones.

That is right for an interrupted run (it continues as it was) and a surprise for a user who
changed the learning rate and reran: the new value is silently ignored. So the Trainer logs each
learning rate the checkpoint overrode, and with `resume_lr="configured"` puts the configured
values back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["RESUME_LR", "learning_rates", "report_restored_lrs"]

RESUME_LR = ("checkpoint", "configured")
log = logging.getLogger("manualpar.trainer")


def _param_groups(state: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The state entries with param groups (dense optimizers, fused table optimizers)."""
    found = {}
    for name, entry in state.items():
        groups = getattr(entry, "param_groups", None)
        if isinstance(groups, list) and all(isinstance(g, dict) and "lr" in g for g in groups):
            found[name] = groups
    return found


def learning_rates(state: Mapping[str, Any]) -> dict[str, list[dict[str, float]]]:
    """Each optimizer entry's learning rate (and a scheduler's `initial_lr`) per param group,
    as configured now."""
    return {
        name: [
            {key: float(group[key]) for key in ("lr", "initial_lr") if key in group}
            for group in groups
        ]
        for name, groups in _param_groups(state).items()
    }


def report_restored_lrs(
    configured: Mapping[str, list[dict[str, float]]], state: Mapping[str, Any], *, keep: str
) -> None:
    """Log every learning rate the load changed; with keep="configured", undo the change."""
    for name, groups in _param_groups(state).items():
        before = configured.get(name, [])
        for index, (group, wanted) in enumerate(zip(groups, before, strict=False)):
            restored = float(group["lr"])
            if restored == wanted["lr"]:
                continue
            if keep == "configured":
                _set_lrs(state[name], index, wanted)
                log.warning(
                    "%s param group %d: learning rate %g configured (the checkpoint had %g; "
                    "resume_lr='configured')",
                    name,
                    index,
                    wanted["lr"],
                    restored,
                )
            else:
                log.warning(
                    "%s param group %d: learning rate %g restored from the checkpoint replaces "
                    "the configured %g; pass Trainer(resume_lr='configured') to train with the "
                    "configured value",
                    name,
                    index,
                    restored,
                    wanted["lr"],
                )


def _set_lrs(entry: Any, index: int, values: Mapping[str, float]) -> None:
    entry.param_groups[index].update(values)
    if index == 0 and isinstance(getattr(type(entry), "lr", None), property):
        entry.lr = values["lr"]  # an optimizer whose param groups are a view of its `lr`
