"""TrainPipeline: batch i + 1's input dist runs ahead of batch i's step, and the numbers are the
plain loop's, bit for bit (1, 2, 3 ranks; a 2 x 2 mesh; bag and sequence collections, hashed
raw ids, managed-collision tables whose raw ids go ahead to their remappers, frozen and uneven
batches); a bad batch, a next batch with other features, a loader that raises or runs out
with a batch in flight, a checkpoint taken with one in flight, and a table frozen in flight
each end as the docs say."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import manualpar as mp
from manualpar import full_tensors
from manualpar.checkpoint.extra import extra_checkpoint_entries
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    HashIds,
    ManagedCollisions,
    RowWiseAdagrad,
    SparseFeatures,
    TablePlacement,
    column_wise,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.errors import EmbeddingInputError
from manualpar.testing import run_distributed


class Model(torch.nn.Module):
    def __init__(self, strategy: mp.ManualParallelStrategy, mesh: bool) -> None:
        super().__init__()
        bags = EmbeddingBagCollection(
            [
                EmbeddingBagConfig("user", 40, 4),
                EmbeddingBagConfig("item", 30, 4, pooling="mean"),
                EmbeddingBagConfig("raw", 25, 4, raw_ids=HashIds(salt=3)),
            ],
            seed=1,
        )
        sequence = EmbeddingCollection([EmbeddingConfig("history", 35, 4)], seed=2)
        layout = strategy.mesh(replicate=2, shard=2) if mesh else None
        shard = 2 if mesh else strategy.world_size
        self.bags = shard_embeddings(
            bags,
            strategy,
            {"user": row_wise(), "item": table_wise(shard - 1), "raw": row_wise()},
            RowWiseAdagrad(lr=0.1),
            mesh=layout,
        )
        self.sequence = shard_embeddings(
            sequence, strategy, {"history": row_wise()}, RowWiseAdagrad(lr=0.1), mesh=layout
        )
        self.bags.tables["raw"].weight.requires_grad_(False)  # a frozen table throughout
        # raw ids remapped: buckets of a few rows, so ids collide and evict from the first steps;
        # the first table of each split by columns (the remap exchange), the second held by rows
        # (whole, or in blocks of buckets), so remapped by its owners in the step
        bags_pair = (("clicks", 16), ("ads", 20))
        self.managed = _managed_pair(
            EmbeddingBagCollection,
            EmbeddingBagConfig,
            bags_pair,
            3,
            strategy,
            layout,
            shard,
            table_wise(shard - 1),
        )
        sequence_pair = (("visits", 12), ("pages", 9))
        self.visits = _managed_pair(
            EmbeddingCollection,
            EmbeddingConfig,
            sequence_pair,
            4,
            strategy,
            layout,
            shard,
            row_wise(),
        )

    def collections(self) -> dict[str, torch.nn.Module]:
        return {
            "bags": self.bags,
            "sequence": self.sequence,
            "managed": self.managed,
            "visits": self.visits,
        }

    def prefetch(self, batch: Batch) -> None:
        self.bags.prefetch(batch[0])
        self.sequence.prefetch(batch[1])
        self.managed.prefetch(batch[2])
        self.visits.prefetch(batch[3])

    def in_flight(self) -> tuple[int, ...]:
        return tuple(emb.batches_in_flight for emb in self.collections().values())

    def loss(self, batch: Batch) -> torch.Tensor:
        pooled = self.bags(batch[0]).values
        rows = self.sequence(batch[1])["history"].values
        managed = self.managed(batch[2]).values
        visits = self.visits(batch[3])
        return (
            pooled.square().sum()
            + rows.sin().sum()
            + managed.cos().sum()
            + visits["visits"].values.sum()
            + visits["pages"].values.square().sum()
        )


Batch = tuple[SparseFeatures, SparseFeatures, SparseFeatures, SparseFeatures]


def _managed_pair(
    collection: type,
    config: type,
    tables: tuple[tuple[str, int], tuple[str, int]],
    seed: int,
    strategy: mp.ManualParallelStrategy,
    layout: Any,
    shard: int,
    by_rows: TablePlacement,
) -> torch.nn.Module:
    """Two ManagedCollisions tables of 4 columns: the first LRU and split by columns (remapped
    through the remap exchange), the second LFU and placed `by_rows` (remapped by its owners,
    in the step; through the exchange on a 2-D mesh)."""
    (split, split_rows), (owned, owned_rows) = tables
    configs = [
        config(split, split_rows, 4, raw_ids=ManagedCollisions(bucket_rows=4)),
        config(owned, owned_rows, 4, raw_ids=ManagedCollisions(policy="lfu", bucket_rows=5)),
    ]
    return shard_embeddings(
        collection(configs, seed=seed),
        strategy,
        {split: column_wise(list(range(shard))), owned: by_rows},
        RowWiseAdagrad(lr=0.1),
        mesh=layout,
    )


def _batch(step: int, rank: int, bad: bool = False) -> Batch:
    g = torch.Generator().manual_seed(100 * step + rank)
    size = 2 + (step + rank) % 3  # uneven batches, different on each rank

    def bags(n: int, top: int) -> list[list[int]]:
        return [
            torch.randint(
                0, top, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g
            ).tolist()
            for _ in range(n)
        ]

    pooled = SparseFeatures.from_dict(
        {
            "user": bags(size, 99 if bad else 40),  # 99: out of range
            "item": bags(size, 30),
            "raw": [[int(x) * 7_919 for x in b] for b in bags(size, 1000)],
        }
    )
    history = SparseFeatures.from_dict({"history": bags(size, 35)})
    spread = 104_729  # raw ids over int64, many more than the rows
    managed = SparseFeatures.from_dict(
        {
            "clicks": [[x * spread for x in b] for b in bags(size, 60)],
            "ads": [[x * spread for x in b] for b in bags(size, 50)],
        }
    )
    visits = SparseFeatures.from_dict(
        {
            "visits": [[x * spread for x in b] for b in bags(size, 40)],
            "pages": [[x * spread for x in b] for b in bags(size, 30)],
        }
    )
    return pooled, history, managed, visits


def _batches(rank: int, count: int, bad_at: int | None = None) -> Iterator:
    for step in range(count):
        yield _batch(step, rank, bad=step == bad_at)


def _snapshot(model: Model) -> dict[str, torch.Tensor]:
    tables: dict[str, torch.Tensor] = {}
    with full_tensors():  # the tables, the remappers' state, the optimizers' state
        for name, emb in model.collections().items():
            tables.update({f"{name}.{k}": v for k, v in emb.state_dict().items()})
            for table, keys in emb.fused_optimizer.state_dict()["state"].items():
                tables.update({f"{name}/{table}/{k}": v for k, v in keys.items()})
    return {k: v.clone() for k, v in tables.items()}


def _train(pipelined: bool, steps: int, mesh: bool = False) -> dict:
    strategy = mp.ManualParallelStrategy()
    model = Model(strategy, mesh)
    losses, in_flight = [], []
    batches = _batches(strategy.rank, steps)
    loop = mp.TrainPipeline(batches, strategy, model.prefetch) if pipelined else batches
    for batch in loop:
        in_flight.append(model.in_flight())
        loss = model.loss(batch)
        loss.backward()
        losses.append(loss.item())
    out = {"losses": losses, "tables": _snapshot(model), "in_flight": in_flight}
    strategy.teardown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "mesh"), [(1, False), (2, False), (3, False), (4, True)])
def test_pipelined_training_equals_the_plain_loop(world: int, mesh: bool) -> None:
    plain = run_distributed(_train, world, args=(False, 5, mesh), timeout=90)
    piped = run_distributed(_train, world, args=(True, 5, mesh), timeout=90)
    for rank in range(world):
        # the batch handed out and the next were both sent ahead, but for the last
        assert piped[rank]["in_flight"] == [(2, 2, 2, 2)] * 4 + [(1, 1, 1, 1)]
        assert plain[rank]["in_flight"] == [(0, 0, 0, 0)] * 5
        assert piped[rank]["losses"] == plain[rank]["losses"]
        assert piped[rank]["tables"].keys() == plain[rank]["tables"].keys()
        for key, value in plain[rank]["tables"].items():
            assert torch.equal(piped[rank]["tables"][key], value), key


def _until_failure(case: str, directory: str) -> dict:
    strategy = mp.ManualParallelStrategy()
    model = Model(strategy, False)
    rank = strategy.rank
    if case == "bad batch":
        batches: Iterator = _batches(rank, 5, bad_at=3 if rank == 1 else None)
    elif case == "loader raises":

        def failing() -> Iterator:
            yield from _batches(rank, 3)
            if rank == 0:
                raise_in_the_loader()
            yield from (_batch(step, rank) for step in range(3, 5))

        batches = failing()
    elif case == "features differ":

        def other_features() -> Iterator:
            for step, (pooled, *rest) in enumerate(_batches(rank, 5)):
                if rank == 1 and step == 3:  # the next batch lacks a feature the others had
                    pooled = pooled.select(["user", "raw"])
                yield (pooled, *rest)

        batches = other_features()
    elif case == "yields None":  # rank 1's batch 3 is None, which is not a batch

        def with_none() -> Iterator:
            for step, batch in enumerate(_batches(rank, 5)):
                yield None if rank == 1 and step == 3 else batch

        batches = with_none()
    elif case == "runs out":
        batches = _batches(rank, 3 if rank == 1 else 5)
    else:
        batches = _batches(rank, 5)
    pipeline = mp.TrainPipeline(batches, strategy, model.prefetch)
    done, error, frames = 0, None, []
    try:
        for step, batch in enumerate(pipeline):
            if case == "frozen in flight" and step == 1:
                model.bags.tables["item"].weight.requires_grad_(False)
            model.loss(batch).backward()
            done += 1
            if case == "checkpoint" and step == 2:  # batch 3 is in flight
                strategy.save_checkpoint(f"{directory}/ckpt", _state(model))
    except Exception as raised:
        error = f"{type(raised).__name__}: {raised}"
        frames = [f.name for f in traceback.extract_tb(raised.__traceback__)]
    out = {"done": done, "error": error, "frames": frames, "tables": _snapshot(model)}
    if case == "checkpoint":  # resume from the checkpoint in a fresh model, plain loop
        fresh = Model(strategy, False)
        strategy.load_checkpoint(f"{directory}/ckpt", _state(fresh))
        for batch in (_batch(step, rank) for step in range(3, 5)):
            fresh.loss(batch).backward()
        out["resumed"] = _snapshot(fresh)
    strategy.teardown()
    return out


def _state(model: Model) -> dict:
    return {"model": model, **extra_checkpoint_entries(model)}  # the fused optimizers too


def raise_in_the_loader() -> None:
    raise ValueError("the loader hit a corrupt shard")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "own", "other"),
    [
        ("bad batch", "feature 'user' (table 'user', 40 rows): id ", "rank 1"),
        ("features differ", "features ['item'] are missing from the batch", "rank 1 refused"),
    ],
)
def test_a_bad_next_batch_stops_every_rank_at_its_prefetch(case: str, own: str, other: str) -> None:
    """Rank 1's batch 3 has an id out of range, or lacks a feature: refused on every rank when
    it is prefetched, during step 2, rank 1 naming what is wrong and rank 0 naming rank 1."""
    results = run_distributed(_until_failure, 2, args=(case, ""), timeout=60)
    for result in results:
        assert result["done"] == 2, result  # batch 3 is checked when prefetched, in step 2
        assert result["error"].startswith("EmbeddingInputError"), result["error"]
    assert own in results[1]["error"]
    assert other in results[0]["error"]


@pytest.mark.timeout(120)
def test_a_loader_error_reaches_the_loop_with_its_traceback_after_the_common_batches() -> None:
    results = run_distributed(_until_failure, 2, args=("loader raises", ""), timeout=60)
    assert [r["done"] for r in results] == [3, 3]
    assert results[0]["error"] == "ValueError: the loader hit a corrupt shard"
    assert "raise_in_the_loader" in results[0]["frames"]
    assert results[1]["error"].startswith("DataError: TrainPipeline: the loader of rank 0 raised")


@pytest.mark.timeout(120)
def test_a_loader_that_yields_none_raises_on_every_rank_after_the_common_batches() -> None:
    """Rank 1 would read None as its loader's end and stop alone, while rank 0 sends batch 3's
    ids: both raise DataError naming rank 1 after the 3 common batches instead."""
    results = run_distributed(_until_failure, 2, args=("yields None", ""), timeout=60)
    for result in results:
        assert result["done"] == 3, result
        assert result["error"].startswith(
            "DataError: TrainPipeline: the loader of rank 1 yielded None as batch 3 (after 3 "
            "batches handed out); every rank raises this after the same batch."
        ), result["error"]


@pytest.mark.timeout(120)
def test_a_loader_that_runs_out_stops_every_rank_at_the_same_batch() -> None:
    ran_out = run_distributed(_until_failure, 2, args=("runs out", ""), timeout=60)
    plain = run_distributed(_train, 2, args=(False, 3), timeout=60)
    for rank in range(2):
        assert ran_out[rank]["done"] == 3 and ran_out[rank]["error"] is None
        for key, value in plain[rank]["tables"].items():
            assert torch.equal(ran_out[rank]["tables"][key], value), key


@pytest.mark.timeout(120)
def test_a_checkpoint_with_a_batch_in_flight_resumes_exactly(tmp_path: Path) -> None:
    results = run_distributed(_until_failure, 2, args=("checkpoint", str(tmp_path)), timeout=60)
    for result in results:
        assert result["done"] == 5 and result["error"] is None
        for key, value in result["tables"].items():
            assert torch.equal(result["resumed"][key], value), key


@pytest.mark.timeout(120)
def test_a_table_frozen_while_a_batch_is_in_flight_is_refused() -> None:
    results = run_distributed(_until_failure, 2, args=("frozen in flight", ""), timeout=60)
    for result in results:
        assert result["done"] == 1
        assert (
            "requires_grad of table(s) ['item'] changed while this batch was in flight"
            in (result["error"])
        )


@pytest.mark.parametrize("collection", [0, 2], ids=["bags", "managed"])
def test_prefetch_twice_is_refused_on_one_process(collection: int) -> None:
    strategy = mp.ManualParallelStrategy()
    model = Model(strategy, False)
    emb = model.bags if collection == 0 else model.managed
    first, second, third = (_batch(step, 0)[collection] for step in range(3))
    emb.prefetch(first)
    emb.prefetch(second)
    with pytest.raises(EmbeddingInputError, match="while 2 batches are in flight"):
        emb.prefetch(third)
    emb(third)  # another batch's forward runs whole meanwhile (validation, say)
    emb(first).values.sum().backward()  # and a held one is taken by its own
    emb.prefetch(third)
    emb.drop_prefetched()
    emb.prefetch(third)  # free again
