"""Collision and eviction rates of a model's managed-collision tables, for the Trainer's logs.

Each raw-id remap (a `RawIdRemap`, the collections' `raw_id_remap`) counts, per table, the
distinct ids of every training step, the collisions (new ids finding no free row in their
bucket) and the evictions (`raw_id_stats`). At every log step the Trainer takes the counts of
the window (resetting them), sums them over the ranks (a sharded remapper counts on the ranks
owning the buckets) and records per table
`raw_ids/<table>/collision_rate` and `eviction_rate` (per distinct id of the window's steps),
and the same over all managed tables as `raw_ids/collision_rate` and `raw_ids/eviction_rate`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from manualpar.embeddings import RawIdRemap
from manualpar.strategy import ManualParallelStrategy

__all__ = ["POSTFIX", "raw_id_rates", "raw_id_remappers"]

# the counts of raw_id_stats the rates read, in the order they are summed over the ranks
COUNTS = ("ids", "collisions", "evictions")
# progress-bar name -> metric, shown when the model has managed tables
POSTFIX = {"collisions": "raw_ids/collision_rate", "evictions": "raw_ids/eviction_rate"}


def raw_id_remappers(model: nn.Module) -> dict[str, RawIdRemap]:
    """The model's raw-id remaps with managed tables, by module path (none: an empty dict)."""
    return {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, RawIdRemap) and module.raw_id_stats()
    }


def raw_id_rates(
    remappers: Mapping[str, RawIdRemap], strategy: ManualParallelStrategy
) -> dict[str, float]:
    """The window's rates (see the module docstring); one all_reduce, on every rank."""
    names, counts = [], []
    for path, remapper in remappers.items():
        for table, stats in remapper.raw_id_stats(reset=True).items():
            names.append((path, table))
            counts.append([float(stats[key]) for key in COUNTS])
    if not names:
        return {}
    totals = strategy.all_reduce(torch.tensor(counts, dtype=torch.float64), op="sum")
    tables = [table for _, table in names]
    out: dict[str, float] = {}
    for (path, table), row in zip(names, totals.tolist(), strict=True):
        label = table if tables.count(table) == 1 else f"{path}.{table}"
        out.update(_rates(f"raw_ids/{label}/", dict(zip(COUNTS, row, strict=True))))
    out.update(_rates("raw_ids/", dict(zip(COUNTS, totals.sum(0).tolist(), strict=True))))
    return out


def _rates(prefix: str, counts: Mapping[str, float]) -> dict[str, float]:
    ids = counts["ids"]
    return {
        f"{prefix}collision_rate": counts["collisions"] / ids if ids else 0.0,
        f"{prefix}eviction_rate": counts["evictions"] / ids if ids else 0.0,
    }
