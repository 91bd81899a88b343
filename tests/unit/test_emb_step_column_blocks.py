"""An owner's equally spaced routes read and written as one strided view (step/column_blocks.py):
the same bits as one slice per route, for the pooled rows a rank receives (add_pooled) and the
output gradient it sends (pack_output_grad); spans that are not equally spaced keep the loop."""

from __future__ import annotations

import torch

from manualpar.embeddings import EmbeddingBagConfig, EmbeddingPlan, column_wise, table_wise
from manualpar.embeddings.step.bag_expansion import FeatureBags, OutputGrad
from manualpar.embeddings.step.column_blocks import column_view, strided_spans
from manualpar.embeddings.step.exchange import ExchangeLayout
from manualpar.embeddings.step.routing import Routing

BATCH = 5


def test_strided_spans_accepts_equal_spaced_blocks_only() -> None:
    assert strided_spans([(0, 4), (8, 12), (16, 20)]) == (3, 0, 8, 4)
    assert strided_spans([(4, 8), (8, 12)]) == (2, 4, 4, 4)
    assert strided_spans([(3, 7)]) == (1, 3, 4, 4)
    assert strided_spans([(0, 4), (8, 12), (12, 16)]) is None  # uneven steps
    assert strided_spans([(0, 4), (4, 6)]) is None  # uneven widths
    assert strided_spans([(0, 4), (2, 6)]) is None  # overlapping
    assert strided_spans([]) is None
    matrix = torch.arange(6 * 20.0).view(6, 20)
    view = column_view(matrix, (3, 2, 6, 4))
    for k in range(3):
        assert torch.equal(view[k], matrix[:, 2 + 6 * k : 6 + 6 * k])


def _layout(configs: list[EmbeddingBagConfig], plan: EmbeddingPlan, rank: int) -> ExchangeLayout:
    return ExchangeLayout(Routing(configs, plan, rank))


def _per_route(layout: ExchangeLayout, owner: int, received: torch.Tensor, bags: FeatureBags):
    out = torch.randn(BATCH, layout.routing.total_dim, generator=torch.Generator().manual_seed(1))
    for route, block, rows in layout.pooled_blocks(owner, received, bags.counts):
        layout.add_block(out, route, block, rows)
    return out


def _check(configs: list[EmbeddingBagConfig], plan: EmbeddingPlan, strided: bool) -> None:
    layout = _layout(configs, plan, rank=0)
    assert (layout._pooled_strided[1] is not None) == strided
    features = len(layout.routing.features)
    bags = FeatureBags(BATCH, (BATCH,) * features, (None,) * features)
    size = layout.output_splits(bags.counts)[1]
    received = torch.randn(size, generator=torch.Generator().manual_seed(2))
    out = torch.randn(BATCH, layout.routing.total_dim, generator=torch.Generator().manual_seed(1))
    layout.add_pooled(out, 1, received, bags)
    assert torch.equal(out, _per_route(layout, 1, received, bags))
    grad = torch.randn(BATCH, layout.routing.total_dim, generator=torch.Generator().manual_seed(3))
    flat, splits = layout.pack_output_grad(OutputGrad(grad, layout.routing), False)
    expected = torch.cat(
        [
            grad[:, slice(*layout.grad_columns(route, False))].flatten()
            for route in layout.routing.routes_to[1]
        ]
    )
    assert splits == [0, expected.numel()]
    assert torch.equal(flat, expected)
    assert flat.data_ptr() != grad.data_ptr()  # a buffer of its own, safe to send
    flag = torch.tensor([float("nan")])  # the non-finite flag after each owner's blocks
    flagged, flagged_splits = layout.pack_output_grad(
        OutputGrad(grad, layout.routing), False, trailer=flag
    )
    assert flagged_splits == [0, expected.numel() + 1]
    assert torch.equal(flagged[:-1], expected) and flagged[-1].isnan()


def test_the_flag_after_each_owners_gradient_is_sent_and_read_around() -> None:
    """Three ranks, every third table on each (one strided block per owner, in one buffer):
    each other owner gets its blocks then the flag; an owner reads each sender's blocks around
    the flag after them (grad_blocks' trailer)."""
    configs = [EmbeddingBagConfig(f"t{i}", 10, 4) for i in range(6)]
    plan = EmbeddingPlan(3, {f"t{i}": table_wise(i % 3) for i in range(6)})
    sender = _layout(configs, plan, rank=0)
    grad = torch.randn(BATCH, sender.routing.total_dim, generator=torch.Generator().manual_seed(3))
    flag = torch.tensor([1.0])
    flat, splits = sender.pack_output_grad(OutputGrad(grad, sender.routing), False, trailer=flag)
    pieces = [torch.zeros(0)]
    for owner in (1, 2):
        columns = [sender.grad_columns(r, False) for r in sender.routing.routes_to[owner]]
        pieces += [grad[:, slice(*c)].flatten() for c in columns] + [flag]
    assert splits == [0, *(p.numel() for p in (torch.cat(pieces[1:4]), torch.cat(pieces[4:])))]
    assert torch.equal(flat, torch.cat(pieces))
    owner = _layout(configs, plan, rank=1)  # what ranks 0 and 2 send it: BATCH bags a table
    counts = [[BATCH, 0, BATCH] for _ in owner.routing.routed_local_shards()]
    assert owner.grad_receive_splits(counts, False, trailer=1) == [
        2 * BATCH * 4 + 1,
        0,
        2 * BATCH * 4 + 1,
    ]
    received = torch.cat([torch.arange(40.0), flag, 100 + torch.arange(40.0), flag])
    blocks = owner.grad_blocks(received, counts, False, trailer=1)
    assert torch.equal(blocks[1][0], torch.arange(20.0, 40.0).view(BATCH, 4))
    assert torch.equal(blocks[0][2], 100 + torch.arange(20.0).view(BATCH, 4))
    assert blocks[0][1] is None


def test_every_other_table_on_the_other_rank_takes_one_strided_view() -> None:
    configs = [EmbeddingBagConfig(f"t{i}", 10, 4) for i in range(6)]
    plan = EmbeddingPlan(2, {f"t{i}": table_wise(i % 2) for i in range(6)})
    _check(configs, plan, strided=True)


def test_unequal_dims_and_column_blocks_keep_the_per_route_loop() -> None:
    configs = [
        EmbeddingBagConfig("a", 10, 4),
        EmbeddingBagConfig("b", 10, 8),
        EmbeddingBagConfig("c", 10, 6),
        EmbeddingBagConfig("d", 10, 4),
    ]
    plan = EmbeddingPlan(
        2,
        {"a": table_wise(1), "b": column_wise([0, 1]), "c": table_wise(1), "d": table_wise(0)},
    )
    _check(configs, plan, strided=False)
