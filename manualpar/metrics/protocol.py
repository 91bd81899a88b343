"""What a metric is, and the two ways its state crosses ranks.

A metric is any object with `reset()` and `compute(strategy)`, plus its own `update(...)`: the
Trainer finds metrics by those two methods (duck typing; no base class to inherit). `compute`
is collective (every rank calls it, every rank gets the same dict) and exact over the samples of
all ranks: additive state is summed in float64 with one all-reduce, and what is not additive
(the ranks of AUC) is gathered whole. With `strategy=None` it computes over this process alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from manualpar.strategy.uneven import all_gather_uneven

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["Metric", "gather_rows", "is_metric", "sum_over_ranks"]


@runtime_checkable
class Metric(Protocol):
    """The protocol every metric follows (also `isinstance(obj, Metric)`)."""

    def reset(self) -> None:
        """Forget every update (start a new evaluation)."""

    def compute(self, strategy: ManualParallelStrategy | None = None) -> dict[str, float]:
        """The metric over every rank's updates; collective: every rank calls it."""


def is_metric(obj: object) -> bool:
    """Whether `obj` has callable `reset` and `compute` (what the Trainer looks for)."""
    return callable(getattr(obj, "reset", None)) and callable(getattr(obj, "compute", None))


def sum_over_ranks(sums: torch.Tensor, strategy: ManualParallelStrategy | None) -> torch.Tensor:
    """`sums` (float64) added over the ranks in one all-reduce; unchanged without a strategy."""
    if strategy is None:
        return sums
    return strategy.all_reduce(sums.to(strategy.device), op="sum")


def gather_rows(rows: torch.Tensor, strategy: ManualParallelStrategy | None) -> torch.Tensor:
    """Every rank's `rows` (their counts may differ, 0 included) stacked in rank order."""
    if strategy is None:
        return rows
    return torch.cat(all_gather_uneven(strategy, rows.to(strategy.device)))
