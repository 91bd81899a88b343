"""Step-addressed data read one batch ahead, in a background thread.

A reader that parses files (the recommender's Criteo reader) costs its whole time inside the
step when the loop calls it between steps. `ReadAhead(data)` calls `data(index + 1, strategy)`
in one worker thread as soon as batch `index` is handed out, so reading overlaps the step (numpy
and torch release the GIL in their kernels). It holds at most one batch beyond the one in use.

It returns exactly what `data` returns, index by index: a request for another index than the one
read ahead (a resume, a restarted epoch) waits for the read in flight, drops it and reads the
requested one. An exception, StopIteration included, reaches the caller at the index it belongs
to with its original traceback, and nothing is left running.

The one condition: `data` must not draw from torch's global random generator (or other state
the training thread uses): a draw in the worker thread would interleave with the model's
(dropout, sampling) and change the numbers. Draw from a `torch.Generator` of your own, as
`dataset_batches` does. That is why the Trainer reads ahead only when asked
(`Trainer(read_ahead=True)`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from manualpar.loop.data import Data
from manualpar.strategy import ManualParallelStrategy

__all__ = ["ReadAhead"]


class ReadAhead:
    """`data`, read one index ahead in a background thread (see the module docstring); call
    `close()` when done (the Trainer does)."""

    def __init__(self, data: Data) -> None:
        self.data = data
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future[Any]] | None = None

    def __call__(self, index: int, strategy: ManualParallelStrategy) -> Any:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == index:
            batch = ahead[1].result()  # re-raises the read's exception, traceback and all
        else:
            if ahead is not None:
                ahead[1].exception()  # wait: `data` is never called from two threads at once
            batch = self.data(index, strategy)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="manualpar-read-ahead")
        self._ahead = (index + 1, self._pool.submit(self.data, index + 1, strategy))
        return batch

    def close(self) -> None:
        """Wait for the read in flight (its result or error is dropped) and stop the thread."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].exception()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
