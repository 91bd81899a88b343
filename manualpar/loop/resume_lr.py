"""What a resume does to learning rates: the checkpoint's replace the configured ones.

That is right for an interrupted run (it continues as it was) and a surprise for a user who
changed the learning rate and reran: the new value is silently ignored. So the Trainer logs each
learning rate the checkpoint overrode, and with `resume_lr="configured"` puts the configured
values back.

A scheduled learning rate is expected to differ from the configured one after a resume: the
restored scheduler moved it. Such a group is reported only when the restored value is not what
its restored schedule gives, or when the schedule's base (`initial_lr`) is not the configured
one; an exact resume of a scheduled run logs nothing.
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


def _schedules(state: Mapping[str, Any]) -> dict[int, Any]:
    """id(optimizer) -> the last scheduler in the state that drives it (the one whose
    `get_last_lr()` is what the optimizer's groups hold after a step)."""
    found = {}
    for entry in state.values():
        # A scheduler first: asking any entry for `.optimizer` read the fused optimizer's
        # deprecated alias of `rule` and printed its FutureWarning on every resume.
        if not callable(getattr(entry, "get_last_lr", None)):
            continue
        optimizer = getattr(entry, "optimizer", None)
        if optimizer is not None:
            found[id(optimizer)] = entry
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


def _as_scheduled(scheduler: Any, index: int, group: Mapping[str, Any], wanted: Mapping) -> bool:
    """True if the group's restored lr is what its restored schedule gives, from the configured
    base learning rate."""
    scheduled = [float(lr) for lr in scheduler.get_last_lr()]
    if index >= len(scheduled) or float(group["lr"]) != scheduled[index]:
        return False
    return (
        "initial_lr" not in wanted or float(group.get("initial_lr", -1.0)) == wanted["initial_lr"]
    )


def report_restored_lrs(
    configured: Mapping[str, list[dict[str, float]]], state: Mapping[str, Any], *, keep: str
) -> None:
    """Log every learning rate the load changed unexpectedly; with keep="configured", undo the
    change. A group driven by a scheduler is expected to differ from its configured lr."""
    schedules = _schedules(state)
    for name, groups in _param_groups(state).items():
        before = configured.get(name, [])
        scheduler = schedules.get(id(state[name]))
        for index, (group, wanted) in enumerate(zip(groups, before, strict=False)):
            restored = float(group["lr"])
            if scheduler is not None:
                if _as_scheduled(scheduler, index, group, wanted):
                    continue
            elif restored == wanted["lr"]:
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
            elif scheduler is not None:
                log.warning(
                    "%s param group %d: the schedule restored from the checkpoint (base learning "
                    "rate %g, now %g) replaces the configured base %g; a scheduled run resumes "
                    "its schedule, so start a new run (another out_dir) to train with another "
                    "learning rate",
                    name,
                    index,
                    float(group.get("initial_lr", restored)),
                    restored,
                    wanted.get("initial_lr", wanted["lr"]),
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
