"""Where a step's time goes: `Trainer(step_times_every=N)` times every N-th step by phase.

One recorder (manualpar/phase_times.py) is shared by the Trainer and the model's sharded
collections, so each second of a timed step counts in one phase only:

    read                    fetching the step's batches (and the agreement that every rank has
                            them); with a pipeline, the next batch's fetch
    ids_exchange            the tables' input dist: checks, hashing, sizes, the ids' all_to_all
                            (a pipelined next batch's too)
    lookup                  looking the bags up in this rank's shards, reading rows in
    pooled_exchange         the pooled rows' way back and adding them in
    dense_forward_backward  the rest of training_step's forward and backward (DDP's and FSDP's
                            gradient exchanges run inside it, overlapped with the backward)
    grad_exchange           the tables' output gradients on their way to the owners
    update                  the tables' fused update, then the dense optimizer step (with the
                            non-finite check and clipping)
    checkpoint              saving (a background save: the copy training waits for)

`time/step` is the whole step, from the read to the checkpoint; what the phases leave of it is
the loop's own work (metric records, validation, the progress bar). On a timed step the device
is synchronized at each phase boundary (see phase_times.py), then each rank's seconds are
gathered in one all_reduce: `time/<phase>` is the most any rank spent in it (the slowest rank
sets the pace), and with several ranks `time_mean/<phase>` is the mean over ranks. The maxima
may come from different ranks (one computes while another waits for it in an exchange), so they
can add up to more than `time/step`; the means add up to `time_mean/step` at most.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from manualpar.embeddings import ShardedEmbeddingBagCollection, ShardedEmbeddingCollection
from manualpar.errors import ConfigError
from manualpar.loop.metrics_file import MetricsFile
from manualpar.phase_times import (
    GRAD_EXCHANGE,
    IDS_EXCHANGE,
    LOOKUP,
    POOLED_EXCHANGE,
    UPDATE,
    PhaseTimes,
)
from manualpar.strategy import ManualParallelStrategy

__all__ = ["CHECKPOINT", "DENSE_FORWARD_BACKWARD", "PHASES", "READ", "StepTimes"]

READ = "read"
DENSE_FORWARD_BACKWARD = "dense_forward_backward"
CHECKPOINT = "checkpoint"
PHASES = (
    READ,
    IDS_EXCHANGE,
    LOOKUP,
    POOLED_EXCHANGE,
    DENSE_FORWARD_BACKWARD,
    GRAD_EXCHANGE,
    UPDATE,
    CHECKPOINT,
)
_Sharded = ShardedEmbeddingBagCollection | ShardedEmbeddingCollection


class StepTimes:
    """Times every `every`-th step (None: none) and appends its record to `metrics`."""

    def __init__(
        self, strategy: ManualParallelStrategy, every: int | None, metrics: MetricsFile
    ) -> None:
        if every is not None and (type(every) is not int or every < 1):
            raise ConfigError(f"Trainer: step_times_every must be >= 1 or None, got {every!r}")
        self.strategy, self.every, self.metrics = strategy, every, metrics
        self.recorder = PhaseTimes(strategy.device)
        self._own: list[tuple[_Sharded, PhaseTimes]] = []
        self._started: float | None = None  # perf_counter at the timed step's start

    def track(self, collections: Iterable[_Sharded]) -> None:
        """Have the collections time their phases into this recorder (until `untrack`)."""
        if self.every is None:
            return
        for module in collections:
            self._own.append((module, module.phase_times))
            module.phase_times = self.recorder

    def untrack(self) -> None:
        """Give the collections their own recorders back; a step timed unfinished is dropped."""
        self.recorder.stop()
        self._started = None
        for module, own in self._own:
            module.phase_times = own
        self._own = []

    def begin(self, step: int) -> None:
        """Before step `step` (counting from 0): start timing it if it is an N-th step."""
        if self.every is None or (step + 1) % self.every:
            return
        self.recorder.start()
        self.recorder.synchronize()  # the work queued before is not this step's
        self._started = time.perf_counter()

    def end(self, step: int) -> None:
        """After the timed step (`step`: the count after it, as records have it): gather every
        rank's seconds (one collective) and record them. Nothing on other steps."""
        if self._started is None:
            return
        self.recorder.synchronize()
        total = time.perf_counter() - self._started
        self._started = None
        seconds = self.recorder.stop()
        names = [*PHASES, "step"]
        # every rank's row, gathered by one sum all_reduce (each rank fills its own row); on
        # the CPU, so that it runs beside the device's work (gloo, as the loop's other agreements)
        ranks = torch.zeros(self.strategy.world_size, len(names), dtype=torch.float64)
        ranks[self.strategy.rank] = torch.tensor([seconds.get(n, 0.0) for n in PHASES] + [total])
        ranks = self.strategy.all_reduce(ranks, op="sum")
        record: dict[str, float] = {
            f"time/{name}": value for name, value in zip(names, ranks.amax(0).tolist(), strict=True)
        }
        if self.strategy.world_size > 1:
            means = ranks.mean(0).tolist()
            record.update({f"time_mean/{n}": v for n, v in zip(names, means, strict=True)})
        self.metrics.append({"step": step, **record})
