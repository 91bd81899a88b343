"""The table batch's lookup and grouping kernels (kernels/table_batch.py): the grouping that keys
each id as it sorts (`group_tables`) gives the groups of keying first (`table_keys`) and then
grouping (`group_rows`), and a lookup that writes its pooled rows (`assign`) gives the bits of
one that adds them into zeros, with no zeros written first."""

from __future__ import annotations

import pytest
import torch

from manualpar.embeddings.kernels.native import native_kernels
from manualpar.embeddings.kernels.table_batch import Segments, pool_tables

pytestmark = pytest.mark.skipif(
    native_kernels() is None, reason="the C++ kernels could not be built on this machine"
)

ROWS = (40, 7, 300)  # three tables


def _bags(generator: torch.Generator, senders: int = 2, bags: int = 9):
    """Every sender's bags of every table (0-3 ids a bag), as a batch lays them out."""
    segments, ids, lengths = Segments(), [], []
    for _ in range(senders):
        for k, rows in enumerate(ROWS):
            bag_lengths = torch.randint(0, 4, (bags,), generator=generator)
            ids.append(torch.randint(0, rows, (int(bag_lengths.sum()),), generator=generator))
            lengths.append(bag_lengths)
            segments.add(k, bags)
    offsets = torch.tensor([0, *torch.tensor(ROWS).cumsum(0).tolist()])
    return torch.cat(ids), torch.cat(lengths), segments.tensor(), offsets


@pytest.mark.parametrize("own", [(0, 27), (27, 54), (5, 40)])
def test_grouping_while_keying_gives_the_groups_of_keys(own):
    kernels = native_kernels()
    ids, lengths, segments, offsets = _bags(torch.Generator().manual_seed(own[0]))
    keys = kernels.table_keys(ids, lengths, segments, offsets)
    expected = kernels.group_rows(keys, lengths, int(offsets[-1]), *own)
    got = kernels.group_tables(ids, lengths, segments, offsets, *own)
    assert got[5] == expected[5]
    for a, b in zip(got[:5], expected[:5], strict=True):
        assert torch.equal(a, b)


def test_grouping_refuses_an_id_outside_its_table_and_bags_outside_the_segments():
    kernels = native_kernels()
    ids, lengths, segments, offsets = _bags(torch.Generator().manual_seed(1))
    bad = ids.clone()
    bad[int(lengths[:9].sum())] = ROWS[1]  # the first id of table 1: one past its rows
    with pytest.raises(RuntimeError, match=f"outside \\[0, {ROWS[1]}\\)"):
        kernels.group_tables(bad, lengths, segments, offsets, 0, 27)
    with pytest.raises(RuntimeError, match="segments end at bag"):
        kernels.group_tables(ids, lengths, segments[:-1], offsets, 0, 27)
    with pytest.raises(RuntimeError, match="not where the one before ends"):
        kernels.group_tables(ids, lengths, segments.flip(0), offsets, 0, 27)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_written_lookup_gives_the_bits_of_adding_into_zeros(dtype):
    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(rows, 16, generator=generator, dtype=dtype) for rows in ROWS]
    weights[2][:] = -0.0  # 0 + -0 is +0 both ways
    weights[0][3] = float("nan")
    ids, lengths, _, _ = _bags(generator, senders=1, bags=200)
    segments = Segments()
    for k in range(len(ROWS)):
        segments.add(k, 200, 0, k * 16, 3 * 16)  # each table's columns of one output
    added = torch.zeros(200, 3 * 16, dtype=dtype)
    pool_tables(weights, ids, lengths, segments.tensor(), [added])
    written = torch.full((200, 3 * 16), 7.0, dtype=dtype)  # stale values, all overwritten
    pool_tables(weights, ids, lengths, segments.tensor(), [written], assign=True)
    width = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(written.view(width), added.view(width))
    assert not bool(torch.signbit(written[:, 32:]).any())  # table 2's -0 rows summed to +0
