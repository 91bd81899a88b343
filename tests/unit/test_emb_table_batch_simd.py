"""The table batch's row-wise Adagrad update, and its lookup, give the portable loop's bits at
every vector level.
At AVX-512 it updates rows eight at a time where the gradient width is a multiple of 8 (a
group's sums, states and steps as vectors), so groups, the rows after the last whole group,
repeated rows (their gradient summed over bags), per-id weights, widths that take the row at a
time loop (4, 37) and a column block of a wider gradient (12 of 24 columns) all run. The lookup
keeps float bags in AVX-512 registers 64 columns at a time: widths below, at and across that
(a partial last vector), added or written, empty bags, -0 and NaN rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from manualpar.embeddings.kernels.bags import BagGradients, RowPass, ShardBags
from manualpar.embeddings.kernels.native import native_kernels
from manualpar.embeddings.kernels.table_batch import (
    Segments,
    TableBatch,
    group_batch,
    pool_tables,
)
from manualpar.embeddings.optim.fused_rowwise import rowwise_adagrad_tables
from tests.support.simd import simd_level

pytestmark = pytest.mark.skipif(
    native_kernels() is None, reason="the C++ kernels could not be built on this machine"
)

# (rows, columns of the block, gradient width, first column of the block in it)
TABLES = ((300, 16, 16, 0), (40, 4, 4, 0), (500, 12, 24, 8), (90, 37, 37, 0))
SENDERS, BAGS = 2, 30


def _batch(generator: torch.Generator, weighted: bool) -> TableBatch:
    segments, ids, lengths = Segments(), [], []
    for _ in range(SENDERS):
        for k, (rows, _, _, _) in enumerate(TABLES):
            bag_lengths = torch.randint(0, 4, (BAGS,), generator=generator)
            ids.append(torch.randint(0, rows, (int(bag_lengths.sum()),), generator=generator))
            lengths.append(bag_lengths)
            segments.add(k, BAGS)
    all_ids = torch.cat(ids)
    per_id = torch.rand(all_ids.shape, generator=generator) if weighted else None
    own = len(TABLES) * BAGS  # sender 0's bags are this rank's own
    bags = ShardBags(all_ids, torch.cat(lengths), per_id, 0, own)
    rows = [0, *torch.tensor([t[0] for t in TABLES]).cumsum(0).tolist()]
    counts = [[BAGS] * len(TABLES) for _ in range(SENDERS)]
    return TableBatch(bags, segments.tensor(), torch.tensor(rows), counts)


def _update(weighted: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7 + weighted)
    weights = [torch.randn(rows, cols, generator=generator) for rows, cols, _, _ in TABLES]
    states = [torch.rand(rows, generator=generator) for rows, _, _, _ in TABLES]
    batch = _batch(generator, weighted)
    group_batch(batch)
    blocks = [
        torch.randn(BAGS, width, generator=generator)
        for _ in range(SENDERS)
        for _, _, width, _ in TABLES
    ]
    widths = [t[2] for t in TABLES]
    col_starts = [t[3] for t in TABLES]
    own = BagGradients(blocks[: len(TABLES)], [0.5] * len(TABLES))
    rowwise_adagrad_tables(weights, states, batch, own, widths, col_starts, RowPass.OWN, 0.1, 1e-8)
    every = BagGradients(blocks, [0.5] * len(TABLES) + [2.0] * len(TABLES))
    rowwise_adagrad_tables(
        weights, states, batch, every, widths, col_starts, RowPass.REST, 0.1, 1e-8
    )
    return torch.cat([w.flatten() for w in weights] + states)


def _every_level_gives_the_portable_bits(run: Callable[[], torch.Tensor]) -> None:
    """`run` at every vector level this CPU has gives the portable loop's bits."""
    with simd_level(0):
        portable = run()
    with simd_level(2) as widest:
        if widest == 0:
            pytest.skip("this CPU has neither AVX2 nor AVX-512: only the portable loops run")
    for level in range(1, widest + 1):
        with simd_level(level) as got:
            assert got == level
            result = run()
        assert torch.equal(result.view(torch.int32), portable.view(torch.int32)), level


@pytest.mark.parametrize("weighted", [False, True])
def test_table_batch_update_equals_the_portable_loop(weighted):
    _every_level_gives_the_portable_bits(lambda: _update(weighted))


def _lookup(assign: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3 + assign)
    widths = (4, 16, 37, 64, 100)
    weights = [torch.randn(50, cols, generator=generator) for cols in widths]
    weights[1][7] = -0.0
    weights[2][4, 5] = float("nan")
    segments, ids, lengths, out_cols = Segments(), [], [], sum(widths)
    offset = 0
    for k, cols in enumerate(widths):
        bag_lengths = torch.randint(0, 30, (BAGS,), generator=generator)
        bag_lengths[1] = 0  # an empty bag
        ids.append(torch.randint(0, 50, (int(bag_lengths.sum()),), generator=generator))
        lengths.append(bag_lengths)
        segments.add(k, BAGS, 0, offset, out_cols)  # each table's columns of one output
        offset += cols
    out = torch.randn(BAGS, out_cols, generator=generator)
    pool_tables(weights, torch.cat(ids), torch.cat(lengths), segments.tensor(), [out], assign)
    return out


@pytest.mark.parametrize("assign", [False, True])
def test_table_batch_lookup_equals_the_portable_loop(assign):
    _every_level_gives_the_portable_bits(lambda: _lookup(assign))
