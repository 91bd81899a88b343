"""TrainPipeline: a loop's batches with the next batch's ids already on their way.

    prefetch = lambda batch: model.sparse.prefetch(batch.sparse)  # each sharded collection
    for batch in mp.TrainPipeline(loader, strategy, prefetch):
        loss = model(batch)       # batch i; batch i + 1 was read, checked and hashed, and its
        loss.backward()           # ids travel to their owners while this step computes
        optimizer.step()

Before it hands out batch i, the pipeline takes batch i + 1 from the loader (read in a
background thread while step i - 1 ran: the loader must not draw from torch's global random
generator, see loop/prefetch.py) and calls `prefetch(batch)`, which starts each sharded
collection's input dist for it (`emb.prefetch(features)`: checks, hashing, the size exchange,
then the ids' all_to_all, in flight on return). Step i's forward takes its own batch's ids,
sent one step earlier. Nothing in an input dist touches a row, so the numbers are those of the
plain loop, bit for bit; see docs/embeddings-pipelining.md, "Pipelined training", for what may
not change while a batch is in flight.

Every rank must hand out the same number of batches, so before each prefetch the ranks agree (one
all_reduce of one number) that every one of them has a next batch: when one rank's loader ends,
every rank stops after the current batch; when one rank's loader raises, that rank re-raises the
error (its own traceback) after the current batch and the others raise a RuntimeError naming it;
when one rank's loader yields None (which would read as "no next batch" on that rank alone),
every rank raises DataError naming it after the current batch.
Leaving the loop early leaves the next batch in flight: call `emb.drop_prefetched()` on each
collection before another pipeline starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from manualpar.errors import DataError
from manualpar.strategy import ManualParallelStrategy

__all__ = ["TrainPipeline"]

log = logging.getLogger("manualpar.trainer")

_READY, _ENDED, _FAILED, _NONE = 0, 1, 2, 3  # what a rank's read gave (agreed: not all _READY)


class TrainPipeline:
    """Iterate `batches` with batch i + 1's input dist started before batch i is handed out
    (see the module docstring). `prefetch(batch)` starts it: call `emb.prefetch(features)` for
    each sharded collection the batch feeds, with the very objects forward will get."""

    def __init__(
        self,
        batches: Iterable[Any],
        strategy: ManualParallelStrategy,
        prefetch: Callable[[Any], None],
    ) -> None:
        self.batches, self.strategy, self.prefetch = batches, strategy, prefetch
        self.handed_out = 0  # batches handed out so far
        self.ran_out: list[int] = []  # ranks whose loader ended (the last time it stopped)

    def __iter__(self) -> Iterator[Any]:
        reader = ThreadPoolExecutor(1, thread_name_prefix="manualpar-pipeline")
        source = iter(self.batches)
        try:
            reading = reader.submit(next, source)
            upcoming = self._agreed(reading)
            if upcoming is None:
                self._stop(reading)
                return
            self.prefetch(upcoming)
            reading = reader.submit(next, source)
            while True:
                current = upcoming
                upcoming = self._agreed(reading)  # read during the previous step
                if upcoming is not None:
                    self.prefetch(upcoming)  # its ids travel during the current step
                    reading = reader.submit(next, source)  # read during the current step
                self.handed_out += 1
                yield current
                if upcoming is None:
                    self._stop(reading)
                    return
        finally:
            reader.shutdown(wait=True)

    def _agreed(self, reading: Future[Any]) -> Any:
        """The next batch, if every rank has one; None on every rank otherwise."""
        flag = torch.tensor([_status(reading)], dtype=torch.int64)
        if int(self.strategy.all_reduce(flag, op="max").item()) != _READY:
            return None
        return reading.result()

    def _stop(self, reading: Future[Any]) -> None:
        """After the last common batch: re-raise this rank's loader error, name the ranks
        whose loader yielded None or raised, or log which ranks' loaders ended."""
        error, status = reading.exception(), _status(reading)
        statuses = self.strategy.all_gather_object(status)
        failed = [rank for rank, s in enumerate(statuses) if s == _FAILED]
        if status == _FAILED:
            assert error is not None
            raise error
        gave_none = [rank for rank, s in enumerate(statuses) if s == _NONE]
        if gave_none:
            raise DataError(
                f"TrainPipeline: the loader of rank {', '.join(map(str, gave_none))} yielded "
                f"None as batch {self.handed_out} (after {self.handed_out} batches handed out); "
                "every rank raises this after the same batch. A loader must not yield None, "
                "which means 'no next batch' to the pipeline: yield the batch, or end the "
                "iterator when this rank's data has ended (every rank then stops after the "
                "same batch)"
            )
        if failed:
            raise DataError(
                f"TrainPipeline: the loader of rank {', '.join(map(str, failed))} raised after "
                f"{self.handed_out} batches (its own error is raised there); every rank stops "
                "after the same batch"
            )
        self.ran_out = [rank for rank, s in enumerate(statuses) if s == _ENDED]
        if self.strategy.is_global_zero and len(self.ran_out) < len(statuses):
            log.warning(
                "TrainPipeline: the loader of rank %s ended after %d batches; every rank stops "
                "there",
                ", ".join(map(str, self.ran_out)),
                self.handed_out,
            )


def _status(reading: Future[Any]) -> int:
    """What this rank's read gave: a batch, the loader's end, an error, or None (waits)."""
    error = reading.exception()
    if error is None:
        return _NONE if reading.result() is None else _READY
    return _ENDED if isinstance(error, StopIteration) else _FAILED
