"""A bad embedding batch on one rank of sharded tables: that rank raises, its peer does not hang.

2 real gloo processes with the bad batch on one rank only: that rank raises EmbeddingInputError,
after telling the other ranks through the step's first (size) exchange, so they raise
EmbeddingInputError naming it at the same step instead of waiting (docs/reliability.md records
the time it takes).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tiny_tables import GOOD, tiny_tables

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingPlan,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.errors import EmbeddingInputError
from manualpar.testing import run_distributed

TABLES = tiny_tables()
# Long enough for a loaded machine: the peer must learn of the refusal from the exchange, so a
# timeout here is a failure of the test whatever its length.
COLLECTIVE_TIMEOUT = 20.0


def _sharded_forward(
    out: str, bad_rank: int, bad_batch: dict[str, list[list[int]]], linger: bool = False
) -> None:
    """One good step, then a step with `bad_batch` on `bad_rank`; each rank writes how long
    that step took to fail into `out`. With `linger`, the bad rank catches the error and stays
    alive (as a loop that skips bad batches would) until its peer has failed, so the peer cannot
    rely on the connection closing."""
    strategy = mp.ManualParallelStrategy()
    plan = EmbeddingPlan(2, {"user": row_wise(), "item": table_wise(1)})
    emb = shard_embeddings(EmbeddingBagCollection(TABLES), strategy, plan, SGD(lr=0.1))
    emb(SparseFeatures.from_dict(GOOD)).values.sum().backward()  # one good step first
    started = time.monotonic()
    try:
        emb(SparseFeatures.from_dict({**GOOD, **bad_batch} if strategy.rank == bad_rank else GOOD))
    except EmbeddingInputError:
        if linger and strategy.rank == bad_rank:
            peer = Path(out) / f"rank_{1 - bad_rank}.s"
            deadline = time.monotonic() + 60
            while not peer.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        raise
    finally:
        (Path(out) / f"rank_{strategy.rank}.s").write_text(f"{time.monotonic() - started:.3f}")
    strategy.teardown()


def _peer_seconds(out: Path, rank: int) -> float:
    seconds = float((out / f"rank_{rank}.s").read_text())
    print(f"\nMEASURED peer rank {rank} failed after {seconds:.2f}s")  # for docs/reliability.md
    return seconds


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("bad_rank", "bad_batch", "message"),
    [
        (
            1,
            {"user": [[1], [2, 10]]},
            "feature 'user' (table 'user', 10 rows): id 10 at position 2 "
            "of the feature's ids (sample 1) is out of range; ids must be in [0, 10)",
        ),
        (
            0,
            {"last_item": [[-1], []]},
            "feature 'last_item' (table 'item', 5 rows): id -1 at "
            "position 0 of the feature's ids (sample 0) is negative; ids must be in [0, 5)",
        ),
    ],
    ids=["out_of_range_on_rank_1", "negative_on_rank_0"],
)
def test_sharded_bad_ids_raise_on_their_rank_and_stop_the_peer_at_the_same_step(
    bad_rank: int, bad_batch: dict, message: str, tmp_path: Path
) -> None:
    # The bad rank stays alive until its peer has failed (as a loop that skips bad batches
    # would): the peer must learn of the refusal from the exchange itself.
    outcomes = run_distributed(
        _sharded_forward,
        world_size=2,
        args=(str(tmp_path), bad_rank, bad_batch, True),
        collective_timeout=COLLECTIVE_TIMEOUT,
        timeout=45,
        allow_failure=True,
    )
    bad, peer = outcomes[bad_rank], outcomes[1 - bad_rank]
    assert bad.error_type == "EmbeddingInputError", bad.describe()
    assert message in bad.error
    assert peer.error_type == "EmbeddingInputError", peer.describe()
    assert peer.error.startswith(
        f"rank {bad_rank} refused its batch (the error is in that "
        "rank's log); every rank stops at this step"
    ), peer.error
    # An EmbeddingInputError (not a CollectiveError) shows the peer learned of the refusal from
    # the exchange, while the bad rank was still alive; the time is printed for the docs.
    _peer_seconds(tmp_path, 1 - bad_rank)
