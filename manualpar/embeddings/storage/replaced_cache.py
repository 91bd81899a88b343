"""A disk-tier table's weight is its row cache: a replaced one is refused wherever it would be
read (the step's guard, step/weight_guard.py; a checkpoint's save, table_blocks.local_shards).

The module's weight and the tier's cache (disk_tier.DiskTable.weight) are the same tensor; a new
Parameter, or new data under the same one, leaves the tier filling, flushing and saving the old
cache while the module holds a tensor the tier never fills. The step and the save raise the same
error, so a checkpoint taken after the replacement does not save the old rows silently.
"""

from __future__ import annotations

import torch

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.storage.disk_tier import DiskTable
from manualpar.errors import BuilderError

__all__ = ["refuse_replaced_cache", "replaced_cache_error"]


def replaced_cache_error(table: str, rank: int, shape: tuple[int, ...]) -> BuilderError:
    """The error for table `table`'s cache weight (`shape`: its slots) replaced on `rank`."""
    rows, cols = shape
    return BuilderError(
        f"{BUILDER}: table {table!r} on rank {rank}: its weight was replaced, but the "
        f"table is on the disk tier: the weight is its row cache ({rows} x {cols} slots "
        "the tier fills from its file), so the step would look up slots of the new tensor "
        "the tier never fills, and checkpoints would save the old rows. Write new rows "
        "through a checkpoint load (the disk tier loads them into its file), or build the "
        f"collection again with {BUILDER}() from a collection holding the new rows"
    )


def refuse_replaced_cache(table: str, store: object, weight: torch.Tensor) -> None:
    """Raise `replaced_cache_error` where `store` is a disk tier's table and the module's
    `weight` is no longer its cache (other data, shape, dtype or device; a detached view of
    the cache counts as it)."""
    if not isinstance(store, DiskTable):
        return
    cache = store.weight
    if (
        weight.device != cache.device
        or weight.data_ptr() != cache.data_ptr()
        or weight.shape != cache.shape
        or weight.dtype != cache.dtype
    ):
        raise replaced_cache_error(table, store.rank, tuple(cache.shape))
