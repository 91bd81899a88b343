"""The Trainer's pipelined fetch: before each step, the next step's batch is fetched and sent
ahead (the model's `prefetch(batch)`, which starts its sharded collections' input dist), so its
ids travel during the step (loop/pipeline.py has the plain loop's version).

Exact: the batches are the step-addressed ones, fetched once each, in the same order of
agreements; the only change is that step s + 1's fetch (and its agreement that every rank has
it) happens before step s trains. A rank whose data runs out is found one step early and every
rank stops at that step as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["StepAhead", "model_prefetch"]

Fetch = Callable[[int], list[Any] | None]


def model_prefetch(model: Any, pipeline: bool, accumulate: int) -> Callable[[Any], None] | None:
    """The model's `prefetch(batch)` if steps are pipelined: asked for (`pipeline`), defined
    by the model, and one micro-batch a step (a collection holds one batch ahead)."""
    prefetch = getattr(model, "prefetch", None)
    if not pipeline or accumulate != 1 or not callable(prefetch):
        return None
    return prefetch


class StepAhead:
    """`batches(step)`: that step's micro-batches (None if a rank's data ran out), with the next
    step's fetched and sent ahead when `prefetch` is given."""

    def __init__(
        self, fetch: Fetch, prefetch: Callable[[Any], None] | None, max_steps: int
    ) -> None:
        self.fetch, self.prefetch, self.max_steps = fetch, prefetch, max_steps
        self._ahead: tuple[int, list[Any] | None] | None = None

    def batches(self, step: int) -> list[Any] | None:
        ahead, self._ahead = self._ahead, None
        batches = ahead[1] if ahead is not None and ahead[0] == step else self.fetch(step)
        if batches is not None and self.prefetch is not None and step + 1 < self.max_steps:
            upcoming = self.fetch(step + 1)
            self._ahead = (step + 1, upcoming)
            if upcoming is not None:
                self.prefetch(upcoming[0])  # its ids travel during this step
        return batches
