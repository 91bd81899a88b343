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
