"""A table's rows split into blocks: as evenly as possible, the first blocks taking the
remainder, and a ManagedCollisions table's in whole buckets, so each block's owner remaps its
own buckets (sharded/remap_at_owner.py). The one split of the plan's row blocks (plan.py), the
remappers' share the planner counts (ids/buckets.py) and the step's blocks."""

from __future__ import annotations

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.id_spaces import ManagedCollisions

__all__ = ["largest_row_block", "row_blocks", "split_evenly"]


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges of `parts` near-equal blocks, the first ones one larger."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for index in range(parts):
        end = start + base + (index < extra)
        bounds.append((start, end))
        start = end
    return bounds


def row_blocks(config: EmbeddingBagConfig, parts: int) -> list[tuple[int, int]]:
    """A table's rows in `parts` near-equal blocks; a ManagedCollisions table's in whole
    buckets, so each block's owner remaps its own buckets (sharded/remap_at_owner.py)."""
    rows, unit = config.num_embeddings, _row_unit(config)
    if unit == 1:
        return split_evenly(rows, parts)
    return [
        (min(start * unit, rows), min(end * unit, rows))
        for start, end in split_evenly(-(-rows // unit), parts)
    ]


def largest_row_block(config: EmbeddingBagConfig, parts: int) -> int:
    """Rows of the largest of `row_blocks(config, parts)`: the first (split_evenly gives the
    first blocks the remainder), without listing every block (the planner asks it per block
    of splits over thousands of ranks)."""
    rows, unit = config.num_embeddings, _row_unit(config)
    units = -(-rows // unit)
    return min(-(-units // parts) * unit, rows)


def _row_unit(config: EmbeddingBagConfig) -> int:
    """The rows a row block holds a multiple of: a ManagedCollisions table's buckets, else 1."""
    raw_ids = config.raw_ids
    return raw_ids.bucket_rows if isinstance(raw_ids, ManagedCollisions) else 1
