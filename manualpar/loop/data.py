"""Step-addressed training data: `data(index, strategy)` returns this rank's batch number
`index`, or raises StopIteration when this rank has none. `dataset_batches` builds one from a
map-style dataset; `step_batches` fetches a step's micro-batches and agrees across ranks whether
every rank has them, so a rank whose data ran out stops every rank instead of hanging them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from manualpar.strategy import ManualParallelStrategy

__all__ = ["Data", "dataset_batches", "step_batches"]

Data = Callable[[int, ManualParallelStrategy], Any]


def dataset_batches(
    dataset: Any,
    global_batch_size: int,
    *,
    seed: int = 0,
    collate: Callable[[list], Any] | None = None,
) -> Data:
    """Step-addressed batches from a map-style dataset: reshuffled each epoch from `seed`, each
    rank taking every world_size-th sample of the global batch (a partial last batch is dropped).
    """
    from torch.utils.data import default_collate

    collate = collate or default_collate
    size = len(dataset)
    if global_batch_size < 1 or size < global_batch_size:
        raise ValueError(
            f"dataset_batches: global_batch_size {global_batch_size} must be in "
            f"[1, len(dataset)={size}]"
        )
    per_epoch = size // global_batch_size
    orders: dict[int, torch.Tensor] = {}

    def data(index: int, strategy: ManualParallelStrategy) -> Any:
        if global_batch_size % strategy.world_size:
            raise ValueError(
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

    return data


def step_batches(
    strategy: ManualParallelStrategy, data: Data, step: int, accumulate: int
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
    (object) gather names the ranks.
    """
    batches: list[Any] = []
    missing: int | None = None
    for micro in range(accumulate):
        index = step * accumulate + micro
        try:
            batches.append(data(index, strategy))
        except StopIteration:
            missing = index
            break
    if not strategy.is_distributed:
        ran_out = missing is not None
    else:
        flag = torch.tensor([float(missing is not None)], dtype=torch.float32)
        ran_out = float(strategy.all_reduce(flag, op="max")[0]) > 0
    if not ran_out:
        return batches, {}
    reports = strategy.all_gather_object(missing)
    return None, {rank: index for rank, index in enumerate(reports) if index is not None}
