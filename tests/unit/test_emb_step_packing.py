"""The sender side of the ids exchange packs whole features as slices of the batch (a run of
consecutive features one piece, not one per feature), with the bits of the per-feature packing;
the table batch reads a sender's bags in place from its payload."""

from __future__ import annotations

import pytest
import torch

from manualpar.embeddings import (
    EmbeddingBagConfig,
    EmbeddingPlan,
    SparseFeatures,
    column_wise,
    data_parallel,
    row_wise,
    table_wise,
)
from manualpar.embeddings.routes import Routing
from manualpar.embeddings.step.bag_expansion import FeatureBags, bag_lengths
from manualpar.embeddings.step.exchange import ExchangeLayout
from manualpar.embeddings.step.sender_bags import feature_runs, weight_bits

TABLES = [
    EmbeddingBagConfig("a", 50, 4, feature_names=("fa",)),
    EmbeddingBagConfig("b", 60, 8, feature_names=("fb", "fb2")),  # one table, two features
    EmbeddingBagConfig("r", 40, 4, feature_names=("fr",)),  # replicated: packed for none
    EmbeddingBagConfig("c", 70, 4, feature_names=("fc",)),
    EmbeddingBagConfig("d", 80, 8, feature_names=("fd",)),
]
KEYS = ("fa", "fb", "fb2", "fr", "fc", "fd")


def _plan(world: int, split_rows: bool = False) -> EmbeddingPlan:
    return EmbeddingPlan(
        world,
        {
            "a": table_wise(0),
            "b": table_wise(world - 1),
            "r": data_parallel(),
            "c": row_wise() if split_rows else table_wise(0),
            "d": column_wise([1, 0]) if world > 1 else table_wise(0),  # two owners
        },
    )


def _features(weighted: bool, variable: bool) -> SparseFeatures:
    generator = torch.Generator().manual_seed(3)
    batch = 5
    bags = (5, 3, 5, 1, 2, 4) if variable else None
    counts = bags or (batch,) * len(KEYS)
    lengths = torch.randint(0, 4, (sum(counts),), generator=generator)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=generator)
    weights = torch.rand(values.numel(), generator=generator) if weighted else None
    inverse = None
    if variable:
        inverse = torch.stack([torch.randint(0, c, (batch,), generator=generator) for c in counts])
    return SparseFeatures(KEYS, values, lengths, weights, bags, inverse)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("variable", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_packing_feature_runs_gives_the_per_feature_payloads(
    world: int, weighted: bool, variable: bool
) -> None:
    layout = ExchangeLayout(Routing(TABLES, _plan(world), 0))
    assert layout._runs is not None
    features = _features(weighted, variable)
    bags = FeatureBags.of(features)
    lengths, _ = bag_lengths(features, bags)
    runs = layout.pack_ids(features, lengths, bags).payloads
    layout._runs = None  # the per-feature packing (a row split's path)
    each = layout.pack_ids(features, lengths, bags).payloads
    assert len(runs) == len(each) == world
    for a, b in zip(runs, each, strict=True):
        assert a.dtype == b.dtype == torch.int64
        assert torch.equal(a, b)


def test_feature_runs_join_consecutive_features_and_leave_row_splits_to_the_features() -> None:
    # features 0-1 to rank 0, 2 to both, 3 to rank 1 twice (two column blocks there), 4 to
    # none (replicated: not in the list), 5 to rank 1
    runs = feature_runs([(0, [0]), (1, [0]), (2, [1, 0]), (3, [1, 1]), (5, [1])], 2)
    assert runs == [[(0, 3)], [(2, 4), (3, 4), (5, 6)]]
    assert feature_runs([(0, [0]), (1, None)], 2) is None
    assert ExchangeLayout(Routing(TABLES, _plan(2, split_rows=True), 0))._runs is None


def test_a_batched_senders_bags_are_read_in_place_from_its_payload() -> None:
    from manualpar.embeddings.step.batched_tables import BatchedTables

    class Parts:  # what BatchedTables reads of StepParts before its first step
        routing = Routing(TABLES, _plan(2), 1)
        layout = ExchangeLayout(routing)

        def name(self, table: int) -> str:
            return TABLES[table].name

    features = _features(False, False)
    bags = FeatureBags.of(features)
    lengths, _ = bag_lengths(features, bags)
    parts = Parts()
    payload = parts.layout.pack_ids(features, lengths, bags).payloads[1]
    batched = BatchedTables(parts)  # type: ignore[arg-type]
    ids, lens, counts = batched.sender_bags(payload, features.batch_size, compact=False)
    cut = parts.layout.unpack_ids(payload, features.batch_size, False)
    assert torch.equal(ids, torch.cat([b[0] for b in cut]))
    assert torch.equal(lens, torch.cat([b[1] for b in cut]))
    assert counts == [b[1].numel() for b in cut]
    base = payload.untyped_storage().data_ptr()
    assert ids.untyped_storage().data_ptr() == lens.untyped_storage().data_ptr() == base


def _per_destination(
    routing: Routing, features: SparseFeatures, bags: FeatureBags
) -> list[torch.Tensor]:
    """Each destination's payload packed on its own, feature by feature (whole features)."""
    lengths = features.lengths.split(list(bags.counts))
    values = features.values.split(features.feature_sizes())
    weights = None if features.weights is None else features.weights.split(features.feature_sizes())
    payloads = []
    for served in routing.routes_to:
        head = [torch.tensor([bags.counts[r.feature] for r in served])] if bags.variable else []
        fs = [r.feature for r in served]
        bits = [] if weights is None else [weight_bits(weights[f]) for f in fs]
        pieces = [*head, *(lengths[f] for f in fs), *(values[f] for f in fs), *bits]
        payloads.append(torch.cat(pieces) if served else torch.empty(0, dtype=torch.int64))
    return payloads


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("variable", [False, True])
@pytest.mark.parametrize("world", [3, 4])
def test_the_other_ranks_payloads_are_packed_as_one_send_buffer(
    world: int, weighted: bool, variable: bool
) -> None:
    features = _features(weighted, variable)
    bags = FeatureBags.of(features)
    lengths, _ = bag_lengths(features, bags)
    for rank in range(world):
        routing = Routing(TABLES, _plan(world), rank)
        packed = ExchangeLayout(routing).pack_ids(features, lengths, bags)
        each = _per_destination(routing, features, bags)
        joined = torch.cat([p for d, p in enumerate(each) if d != rank])
        assert packed.send.dtype == torch.int64
        assert torch.equal(packed.send, joined)  # the bytes the per-destination join sent
        assert all(torch.equal(a, b) for a, b in zip(packed.payloads, each, strict=True))
        base = packed.send.untyped_storage().data_ptr()  # one buffer: ours after the sent
        assert packed.payloads[rank].untyped_storage().data_ptr() == base
        # a row split's per-feature packing: the same single buffer
        split = ExchangeLayout(Routing(TABLES, _plan(world, split_rows=True), rank))
        cut = split.pack_ids(features, lengths, bags)
        others = [p for d, p in enumerate(cut.payloads) if d != rank]
        assert torch.equal(cut.send, torch.cat(others))
        assert cut.send.untyped_storage().data_ptr() == others[0].untyped_storage().data_ptr()


ROW_TABLES = [
    EmbeddingBagConfig("s", 1000, 4, feature_names=("s1", "s2")),  # one table, two features
    EmbeddingBagConfig("t", 77, 8, feature_names=("t1",)),  # rows that split unevenly
]


@pytest.mark.parametrize(("world", "rank"), [(2, 0), (2, 1), (3, 1), (4, 3)])
def test_a_row_wise_plans_ids_are_packed_in_one_pass_with_the_per_feature_bits(
    world: int, rank: int
) -> None:
    layout = ExchangeLayout(
        Routing(ROW_TABLES, EmbeddingPlan(world, {"s": row_wise(), "t": row_wise()}), rank)
    )
    assert layout._every_split is not None
    generator = torch.Generator().manual_seed(world + rank)
    lengths = torch.randint(0, 7, (3 * 40,), generator=generator)  # empty bags too
    sizes = lengths.view(3, 40).sum(1).tolist()
    rows = [1000, 1000, 77]
    values = torch.cat(
        [torch.randint(0, r, (n,), generator=generator) for r, n in zip(rows, sizes, strict=True)]
    )
    values[:4] = torch.tensor([0, 999, 500, 499])  # range edges
    features = SparseFeatures(("s1", "s2", "t1"), values, lengths)
    bags = FeatureBags.of(features)
    grid, _ = bag_lengths(features, bags)
    packed = layout.pack_ids(features, grid, bags)
    layout._every_split = None  # the per-feature packing
    each = layout.pack_ids(features, grid, bags)
    assert len(packed.payloads) == world
    for a, b in zip([*packed.payloads, packed.send], [*each.payloads, each.send], strict=True):
        assert a.dtype == b.dtype == torch.int64
        assert torch.equal(a, b)


def test_plans_mixing_whole_features_and_row_splits_are_packed_per_feature() -> None:
    assert ExchangeLayout(Routing(TABLES, _plan(2, split_rows=True), 0))._every_split is None


def test_a_row_splits_bags_with_ids_at_every_owner_travel_in_the_plain_layout() -> None:
    plan = EmbeddingPlan(2, {"s": row_wise(), "t": row_wise()})
    layout = ExchangeLayout(Routing(ROW_TABLES, plan, 0))
    batch = 4
    lengths = torch.full((3 * batch,), 2)
    values = torch.tensor([0, 999] * (2 * batch) + [0, 76] * batch)  # each half of each table
    features = SparseFeatures(("s1", "s2", "t1"), values, lengths)
    bags = FeatureBags.of(features)
    payloads = layout.pack_ids(features, bag_lengths(features, bags)[0], bags).payloads
    assert layout.kept_bags(payloads, batch) is None  # no index, one block per owner
    values[:2] = torch.tensor([3, 7])  # s1's first bag: no id in rank 1's rows
    payloads = layout.pack_ids(features, bag_lengths(features, bags)[0], bags).payloads
    kept = layout.kept_bags(payloads, batch)
    assert kept is not None and kept[0] is None and kept[1] is not None
    first, *rest = kept[1]
    assert first is not None and torch.equal(first, torch.arange(1, batch))
    assert rest == [None, None]


def test_a_row_split_over_more_groups_than_one_pass_takes_is_packed_per_feature() -> None:
    from manualpar.embeddings.step.sender_bags import SPLIT_PACK_GROUPS

    world = SPLIT_PACK_GROUPS + 1
    plan = EmbeddingPlan(world, {"s": row_wise(), "t": row_wise()})
    assert ExchangeLayout(Routing(ROW_TABLES, plan, 0))._every_split is None
