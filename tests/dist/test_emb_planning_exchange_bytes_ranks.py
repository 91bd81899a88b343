"""The byte model of a step's exchanges is exact: on 2 and 3 ranks, with row-, table-, column-
and table-row-wise tables, weighted and mean-pooled features, a frozen table and uneven batches,
and for a sequence collection's compact exchange, `exchange_bytes` predicts every split each
all_to_all really sends, byte for byte; and `expected_exchange_bytes` is the mean of the exact
counts over uniform ids."""

from __future__ import annotations

import pytest
import torch

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    column_wise,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.planning.exchange_bytes import (
    EXCHANGES,
    exchange_bytes,
    expected_exchange_bytes,
)
from manualpar.testing import run_distributed

CONFIGS = [
    EmbeddingBagConfig("user", 60, 8),
    EmbeddingBagConfig("item", 40, 6, feature_names=("item", "last_item"), pooling="mean"),
    EmbeddingBagConfig("wide", 30, 12),
    EmbeddingBagConfig("cold", 20, 4),
]
KIND = {
    "sizes": "ids all_to_all",
    "ids": "ids all_to_all",
    "pooled": "pooled output all_to_all",
    "gradients": "output gradient all_to_all",
}


def _plan(world: int) -> EmbeddingPlan:
    return EmbeddingPlan(
        world,
        {
            "user": row_wise(),
            "item": table_wise(world - 1),
            "wide": column_wise(list(range(world))),
            "cold": row_wise(),
        },
    )


def _batch(rank: int, weighted: bool) -> SparseFeatures:
    g = torch.Generator().manual_seed(rank)
    size = 3 + 2 * rank  # uneven
    bags = {
        c: [
            torch.randint(
                0, rows, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g
            ).tolist()
            for _ in range(size)
        ]
        for c, rows in (("user", 60), ("item", 40), ("last_item", 40), ("wide", 30), ("cold", 20))
    }
    if not weighted:
        return SparseFeatures.from_dict(bags)
    weights = {k: [[0.5] * len(b) for b in v] for k, v in bags.items()}
    return SparseFeatures.from_dict(bags, weights)


# the same tables, looked up one row per id (a sequence collection)
SEQUENCE = [
    EmbeddingConfig(c.name, c.num_embeddings, c.embedding_dim, feature_names=c.feature_names)
    for c in CONFIGS
]


def _recorded_step(weighted: bool, sequence: bool = False) -> list[dict[str, list[int]]]:
    """This rank's send splits in bytes per exchange of one step (the pooled rows: what it
    receives, since those flow the other way)."""
    strategy = mp.ManualParallelStrategy()
    world, rank = strategy.world_size, strategy.rank
    with mp.empty_init():
        ebc = (
            EmbeddingCollection(SEQUENCE, seed=0)
            if sequence
            else EmbeddingBagCollection(CONFIGS, seed=0)
        )
    emb = shard_embeddings(ebc, strategy, _plan(world), RowWiseAdagrad(lr=0.1))
    emb.tables["cold"].weight.requires_grad_(False)
    calls: list[tuple[str, list[int], list[int], int]] = []
    start = strategy.all_to_all_async

    def recording(tensor, send, receive, *, name="", group=None):  # type: ignore[no-untyped-def]
        calls.append((name, list(send), list(receive), tensor.element_size()))
        return start(tensor, send, receive, name=name, group=group)

    strategy.all_to_all_async = recording  # type: ignore[method-assign]
    if sequence:
        out = emb(_batch(rank, weighted))
        sum(out[key].values.sum() for key in out.keys).backward()
    else:
        emb(_batch(rank, weighted)).values.sum().backward()
    strategy.teardown()
    sent: dict[str, list[int]] = {}
    for kind, (name, send, receive, size) in zip(EXCHANGES, calls, strict=True):
        assert name.endswith(KIND[kind]), (kind, name)
        splits = receive if kind == "pooled" else send
        sent[kind] = [0 if d == rank else n * size for d, n in enumerate(splits)]
    return [sent]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world", "weighted", "sequence"), [(2, False, False), (3, True, False), (3, False, True)]
)
def test_the_byte_model_predicts_every_split(world: int, weighted: bool, sequence: bool) -> None:
    recorded = run_distributed(_recorded_step, world, args=(weighted, sequence), timeout=60)
    model = exchange_bytes(
        SEQUENCE if sequence else CONFIGS,
        _plan(world),
        [_batch(r, weighted) for r in range(world)],
        frozen=frozenset({"cold"}),
        full_rows=True,  # row-wise Adagrad needs whole rows of the column-split table
    )
    for rank, (sent,) in enumerate(recorded):
        for kind in EXCHANGES:
            if kind == "pooled":  # received by this rank from each owner
                predicted = [model.bytes[kind][owner][rank] for owner in range(world)]
            else:
                predicted = model.bytes[kind][rank]
            assert sent[kind] == predicted, (rank, kind)


@pytest.mark.parametrize("sequence", [False, True], ids=["bags", "sequence"])
def test_expected_bytes_are_the_mean_over_uniform_ids(sequence: bool) -> None:
    plan = _plan(2)
    per_bag = {"user": 2.0, "item": 1.0, "last_item": 1.0, "wide": 3.0, "cold": 2.0}
    configs = SEQUENCE if sequence else CONFIGS
    expected = expected_exchange_bytes(configs, plan, 4, per_bag, full_rows=True)
    g = torch.Generator().manual_seed(0)
    total = {k: [[0.0, 0.0], [0.0, 0.0]] for k in EXCHANGES}
    trials = 400
    for _ in range(trials):
        batches = []
        for _rank in range(2):
            bags = {
                name: [
                    torch.randint(0, rows, (int(per_bag[name]),), generator=g).tolist()
                    for _ in range(4)
                ]
                for name, rows in (
                    ("user", 60),
                    ("item", 40),
                    ("last_item", 40),
                    ("wide", 30),
                    ("cold", 20),
                )
            }
            batches.append(SparseFeatures.from_dict(bags))
        exact = exchange_bytes(configs, plan, batches, full_rows=True)
        for k in EXCHANGES:
            for s in range(2):
                for d in range(2):
                    total[k][s][d] += exact.bytes[k][s][d] / trials
    for k in EXCHANGES:
        for s in range(2):
            for d in range(2):
                assert total[k][s][d] == pytest.approx(expected.bytes[k][s][d], rel=0.03), (k, s, d)
    assert expected.sent(0) == pytest.approx(sum(sum(expected.bytes[k][0]) for k in EXCHANGES))
