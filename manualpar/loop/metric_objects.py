"""Metric objects among validation_step's values: accumulated over a pass, computed exactly.

A mean of per-rank means is wrong for metrics that are not means over equal counts (AUC, NDCG,
a mean over uneven batches). A metric object has `reset()` and `compute(strategy) ->
{name: value}`: validation_step updates it and returns it; the Trainer resets it before each
pass and, after it, calls `compute(strategy)` on every rank (a collective: the object gathers
or sums its state over ranks itself). Recognized by those two methods alone (duck typing).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from manualpar.errors import ConfigTypeError, MetricError
from manualpar.strategy import ManualParallelStrategy

__all__ = ["compute_metrics", "held_metrics", "is_metric", "reset_all"]


def is_metric(value: Any) -> bool:
    return (
        not isinstance(value, (type, torch.Tensor))
        and callable(getattr(value, "reset", None))
        and callable(getattr(value, "compute", None))
    )


def held_metrics(model: Any) -> list[Any]:
    """The metric objects `model` holds: submodules, and attributes of any submodule (directly,
    or as values of a dict, list or tuple attribute)."""
    found: dict[int, Any] = {}
    modules = model.modules() if isinstance(model, nn.Module) else [model]
    for module in modules:
        for value in _attributes(module):
            if is_metric(value):
                found.setdefault(id(value), value)
    return list(found.values())


def _attributes(module: Any) -> Iterator[Any]:
    yield module
    if type(module).__module__.startswith("torch."):
        return  # torch's own modules (DDP, containers) hold no metric objects of the user's
    for name, value in vars(module).items():
        if name in ("_parameters", "_buffers", "_modules"):
            continue
        yield value
        if isinstance(value, Mapping):
            yield from value.values()
        elif isinstance(value, (list, tuple)):
            yield from value


def compute_metrics(
    metrics: Mapping[str, Any], strategy: ManualParallelStrategy
) -> dict[str, float]:
    """Every metric's `compute(strategy)`, in name order (the same collectives on every rank),
    merged. A key one metric computes keeps its name; a key several compute (the `count` of
    `AUC` and `LogLoss`) is namespaced by each one's name in validation_step's dict:
    `{"auc": AUC(), "ll": LogLoss()}` gives auc, log_loss, normalized_entropy, auc/count and
    ll/count. The rule depends on which objects are returned, never on their values."""
    computed = {name: _computed(name, metrics[name], strategy) for name in sorted(metrics)}
    owners: dict[str, int] = {}
    for values in computed.values():
        for key in values:
            owners[key] = owners.get(key, 0) + 1
    merged: dict[str, float] = {}
    for name, values in computed.items():
        for key, value in values.items():
            recorded = key if owners[key] == 1 else f"{name}/{key}"
            if recorded in merged:
                raise MetricError(
                    f"validation_step's metric {name!r} computes {key!r}, recorded as "
                    f"{recorded!r}, which another metric also computes; rename one of them"
                )
            merged[recorded] = value
    return merged


def _computed(name: str, metric: Any, strategy: ManualParallelStrategy) -> dict[str, float]:
    computed = metric.compute(strategy)
    if not isinstance(computed, Mapping):
        raise ConfigTypeError(
            f"validation_step's {name!r} ({type(metric).__name__}): compute(strategy) "
            f"returned {type(computed).__name__}; return a dict of name -> number"
        )
    return {key: float(value) for key, value in computed.items()}


def reset_all(metrics: Iterable[Any]) -> set[int]:
    """Reset each metric object; the ids of those reset."""
    done: set[int] = set()
    for metric in metrics:
        if id(metric) not in done:
            metric.reset()
            done.add(id(metric))
    return done
