"""Many equal column blocks of a (batch, total dim) matrix as one strided view.

An owner's routes often cover equally wide, equally spaced columns of the step's output (a
table-wise plan of tables of one dim: each table's columns, one after another, or every
world-size-th table's). Their pooled rows then arrive, and their output gradient leaves, as
(routes, batch, width) blocks, which one strided view of the output reads or writes at once:
one tensor operation for all of an owner's routes instead of one per route, with the same
elementwise arithmetic (so the same bits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Strided", "column_view", "strided_spans"]

# (blocks, first column, column step between blocks, width)
Strided = tuple[int, int, int, int]


def strided_spans(spans: Sequence[tuple[int, int]]) -> Strided | None:
    """`spans` ([start, end) column ranges, in order) as (blocks, first, step, width) when they
    are equally wide, start a fixed step apart and do not overlap; None otherwise."""
    if not spans:
        return None
    first, width = spans[0][0], spans[0][1] - spans[0][0]
    step = spans[1][0] - first if len(spans) > 1 else width
    if width <= 0 or step < width:
        return None
    for k, (start, end) in enumerate(spans):
        if start != first + k * step or end - start != width:
            return None
    return len(spans), first, step, width


def column_view(matrix: torch.Tensor, strided: Strided) -> torch.Tensor:
    """The (blocks, rows, width) view of `matrix`'s (rows, columns) blocks `strided`."""
    blocks, first, step, width = strided
    rows, columns = matrix.stride()
    return matrix.as_strided(
        (blocks, matrix.shape[0], width),
        (step * columns, rows, columns),
        matrix.storage_offset() + first * columns,
    )
