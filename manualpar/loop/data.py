"""Step-addressed training data: `data(index, strategy)` returns this rank's batch number
`index`, or raises StopIteration when this rank has none. `dataset_batches` builds one from a
map-style dataset; `step_batches` fetches a step's micro-batches and agrees across ranks whether
every rank has them, so a rank whose data ran out stops every rank instead of hanging them, and
a rank whose data returned None (not a batch) makes every rank raise DataError at that step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from manualpar.errors import DataError
from manualpar.strategy import ManualParallelStrategy

__all__ = ["Data", "dataset_batches", "step_batches"]

Data = Callable[[int, ManualParallelStrategy], Any]

# What a rank's fetch gave, agreed by the max over ranks: a None batch outranks a data end.
_READY, _ENDED, _NONE = 0, 1, 2


def dataset_batches(
    dataset: Any,
    global_batch_size: int,
    *,
    seed: int = 0,
    collate: Callable[[list], Any] | None = None,
) -> Data:
    """Step-addressed batches from a map-style dataset: reshuffled each epoch from `seed`, each
    rank taking every world_size-th sample of the global batch (a partial last batch is dropped).
    The function carries `global_batch_size`, which the Trainer's checkpoints record, so a
    resume with another batch is refused (loop/run_record.py).
    """
    from torch.utils.data import default_collate

    collate = collate or default_collate
    size = len(dataset)
    if global_batch_size < 1 or size < global_batch_size:
        raise DataError(
            f"dataset_batches: global_batch_size {global_batch_size} must be in "
            f"[1, len(dataset)={size}]"
        )
    per_epoch = size // global_batch_size
    orders: dict[int, torch.Tensor] = {}

    def data(index: int, strategy: ManualParallelStrategy) -> Any:
        if global_batch_size % strategy.world_size:
            raise DataError(
                f"dataset_batches: global_batch_size {global_batch_size} is not a "
                f"multiple of the world size {strategy.world_size}"
            )
        epoch, position = divmod(index, per_epoch)
        if epoch not in orders:
            orders.clear()  # one epoch's permutation at a time
            orders[epoch] = torch.randperm(
                size, generator=torch.Generator().manual_seed(seed + epoch)
            )
        chunk = orders[epoch][position * global_batch_size : (position + 1) * global_batch_size]
        return collate([dataset[i] for i in chunk[strategy.rank :: strategy.world_size].tolist()])

    data.global_batch_size = global_batch_size  # type: ignore[attr-defined]
    return data


def step_batches(
    strategy: ManualParallelStrategy, data: Data, step: int, accumulate: int, name: str = "data"
) -> tuple[list[Any] | None, dict[int, int]]:
    """Step `step`'s `accumulate` micro-batches, or (None, {rank: missing batch index}) on every
    rank if any rank's data ran out.

    All of a step's batches are fetched before any is trained on, so no rank starts a forward or
    backward (and their collectives) that another rank cannot join, and a step is taken whole or
    not at all (a partial last step is dropped, like drop_last). The agreement costs one
    all-reduce of one number per optimizer step, a CPU tensor so that it runs on gloo even in a
    CUDA job (no device sync); about 0.1 ms on 2 CPU processes, nothing at world size 1. It
    cannot ride on a collective the step runs anyway: the first of those (DDP's, FSDP's, the
    tables') happen inside the forward or backward, too late. Only when a rank ran out, a second
    (object) gather names the ranks. A batch of None rides on the same agreement: every rank
    raises DataError naming the ranks that gave one (`name` is the data's name in it).
    """
    batches: list[Any] = []
    status = _READY
    for index in range(step * accumulate, (step + 1) * accumulate):
        try:
            batch = data(index, strategy)
        except StopIteration:
            status = _ENDED
            break
        if batch is None:
            status = _NONE
            break
        batches.append(batch)
    if not strategy.is_distributed:
        agreed = status
    else:
        flag = torch.tensor([float(status)], dtype=torch.float32)
        agreed = int(strategy.all_reduce(flag, op="max")[0])
    if agreed == _READY:
        return batches, {}
    reports = strategy.all_gather_object(None if status == _READY else (status, index))
    if agreed == _NONE:
        raise DataError(_none_message(name, reports))
    return None, {rank: report[1] for rank, report in enumerate(reports) if report is not None}


def _none_message(name: str, reports: list[tuple[int, int] | None]) -> str:
    where = ", ".join(
        f"batch {report[1]} on rank {rank}"
        for rank, report in enumerate(reports)
        if report is not None and report[0] == _NONE
    )
    return (
        f"{name} returned None for {where}; every rank raises this at the same step. A batch "
        "must not be None, which means 'no batch' to the loop: return the batch, or raise "
        "StopIteration when this rank's data has ended (every rank then stops there)"
    )
