"""Scoring: a model's per-sample outputs over step-addressed data, gathered in input order.

    for scores in trainer.predict(model, data):      # on every rank, in lockstep
        ...                                          # one global batch's outputs, in order
    scores = torch.cat(list(mp.predict(model, data, strategy)))

The model defines `predict_step(batch) -> tensor`, one row per sample of this rank's batch
(first dim: samples). Batch i runs on every rank together, since predict_step may run
collectives (a sharded table's lookup, a DDP forward), and the ranks' outputs are gathered
(their batches may differ in size, e.g. the last one) and put back in the global order:
with `order="interleaved"` (default) rank r holds samples r, r + W, r + 2W, ... of each global
batch of a job of W ranks, as `dataset_batches` and `scoring_batches` split one; with
"by_rank" rank 0's samples come first, then rank 1's (contiguous blocks). Every rank gets the
same tensor for each batch. As for validation (loop/validation.py), the ranks agree before each
batch whether every one has it; the pass ends on every rank at the first batch some rank has
none for, and if others still had batches there, rank 0 logs that they were not scored
(`ran_out` names the ranks).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from manualpar.errors import ConfigError, ConfigTypeError, DataError
from manualpar.loop.data import Data, step_batches
from manualpar.strategy import ManualParallelStrategy
from manualpar.strategy.uneven import all_gather_uneven

__all__ = ["ORDERS", "Predictions", "predict", "scoring_batches"]

log = logging.getLogger("manualpar.trainer")
ORDERS = ("interleaved", "by_rank")


class Predictions:
    """The outputs of `predict_step`, one tensor per global batch, in the global sample order
    (iterate once, on every rank together). After the pass, `batches` says how many ran and
    `ran_out` which ranks' data ended first ({rank: batch index}; empty when every rank's
    data ended at the same batch)."""

    def __init__(
        self,
        model: Any,
        data: Data,
        strategy: ManualParallelStrategy,
        *,
        steps: int | None = None,
        order: str = "interleaved",
        autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        if order not in ORDERS:
            raise ConfigError(f"predict: order must be one of {ORDERS}, got {order!r}")
        if not callable(getattr(model, "predict_step", None)):
            raise ConfigTypeError(
                f"predict: {type(model).__name__} has no predict_step(batch); define it to "
                "return one row of outputs per sample of the batch (first dim: samples)"
            )
        self.model, self.data, self.strategy = model, data, strategy
        self.steps, self.order, self.autocast = steps, order, autocast
        self.batches = 0
        self.ran_out: dict[int, int] = {}

    def __iter__(self) -> Iterator[torch.Tensor]:
        """In eval mode (dropout off, as validation runs), the model's mode put back after."""
        training = self.model.training
        self.model.eval()
        try:
            yield from self._pass()
        finally:
            self.model.train(training)

    def _pass(self) -> Iterator[torch.Tensor]:
        index = 0
        while self.steps is None or index < self.steps:
            batches, ran_out = step_batches(self.strategy, self.data, index, 1, name="data")
            if batches is None:
                self._ended(index, ran_out)
                return
            with torch.no_grad(), self.autocast():
                outputs = self.model.predict_step(batches[0])
            yield self._gathered(_checked(outputs, index), index)
            index += 1
            self.batches = index

    def _gathered(self, outputs: torch.Tensor, index: int) -> torch.Tensor:
        """Every rank's outputs of batch `index`, in the global sample order."""
        if not self.strategy.is_distributed:
            return outputs.detach()
        parts = all_gather_uneven(self.strategy, outputs.to(self.strategy.device).contiguous())
        if self.order == "by_rank":
            return torch.cat(parts)
        total, world = sum(len(p) for p in parts), len(parts)
        lengths = [len(p) for p in parts]
        if lengths != [len(range(r, total, world)) for r in range(world)]:
            raise DataError(
                f"predict(order='interleaved'): batch {index} holds {lengths} samples on ranks "
                f"0..{world - 1}, which is no interleaved split of {total} samples (rank r "
                "takes samples r, r + world_size, ...: each rank one more than the next at "
                "most); split each global batch that way (scoring_batches does), or pass "
                "order='by_rank' for contiguous blocks"
            )
        ordered = parts[0].new_empty((total, *parts[0].shape[1:]))
        for rank, part in enumerate(parts):
            ordered[rank::world] = part
        return ordered

    def _ended(self, index: int, ran_out: dict[int, int]) -> None:
        """Every rank stops at batch `index`; say so if some rank still had batches."""
        self.batches = index
        if len(ran_out) == self.strategy.world_size:
            return  # every rank's data ended here: the normal end
        self.ran_out = ran_out
        if self.strategy.is_global_zero:
            where = ", ".join(f"rank {r} (batch {i})" for r, i in ran_out.items())
            log.warning(
                "predict: data ran out on %s; every rank stops after %d batches, so the other "
                "ranks' batches from %d on were not scored (give every rank as many batches: "
                "scoring_batches does)",
                where,
                index,
                index,
            )


def predict(
    model: Any,
    data: Data,
    strategy: ManualParallelStrategy,
    *,
    steps: int | None = None,
    order: str = "interleaved",
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Predictions:
    """`model.predict_step` over `data`'s batches in eval mode without gradients, under
    `autocast()`, the outputs gathered in the global sample order. From batch 0 on, up to
    `steps` batches if given; see the module docstring."""
    return Predictions(model, data, strategy, steps=steps, order=order, autocast=autocast)


def _checked(outputs: Any, index: int) -> torch.Tensor:
    if not isinstance(outputs, torch.Tensor) or outputs.dim() == 0:
        got = f"a {outputs.dim()}-d tensor" if isinstance(outputs, torch.Tensor) else outputs
        raise ConfigTypeError(
            f"predict_step returned {got!r} for batch {index}; return a tensor with one row "
            "per sample of the batch (first dim: samples), e.g. logits.reshape(-1)"
        )
    return outputs


def scoring_batches(
    dataset: Any, global_batch_size: int, *, collate: Callable[[list], Any] | None = None
) -> Data:
    """Step-addressed batches of a map-style dataset for scoring: in order, every sample once
    (no shuffle, nothing dropped); rank r takes samples r, r + W, ... of each global batch of a
    job of W ranks (predict's "interleaved" order). A last batch too small to give every rank a
    sample joins the one before it, so no rank's data ends first."""
    from torch.utils.data import default_collate

    collate = collate or default_collate
    size = len(dataset)
    if global_batch_size < 1:
        raise DataError(f"scoring_batches: global_batch_size must be >= 1, got {global_batch_size}")

    def data(index: int, strategy: ManualParallelStrategy) -> Any:
        world = strategy.world_size
        if size < world or global_batch_size < world:
            raise DataError(
                f"scoring_batches: {size} samples in global batches of {global_batch_size} "
                f"cannot give each of {world} ranks a sample; use a batch (and dataset) of at "
                "least the world size"
            )
        count = -(-size // global_batch_size)
        if count > 1 and size - (count - 1) * global_batch_size < world:
            count -= 1  # the small remainder joins the last full batch
        if index >= count:
            raise StopIteration
        end = size if index == count - 1 else (index + 1) * global_batch_size
        samples = range(index * global_batch_size + strategy.rank, end, world)
        return collate([dataset[i] for i in samples])

    return data
