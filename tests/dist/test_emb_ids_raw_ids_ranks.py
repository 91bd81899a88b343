"""Raw-id tables sharded over 2 and 3 gloo ranks give the pooled outputs and trained tables of
the single-process reference (world size 1: tests/unit/test_emb_ids_raw_ids.py), whether the
managed tables are remapped through the remap exchange or by their owner in the step."""

from __future__ import annotations

from pathlib import Path

import pytest
from raw_id_cases import (
    EXCHANGED,
    HASHED_TABLES,
    MANAGED_TABLES,
    PLACEMENTS,
    check_against_reference,
    check_state,
    checkpoint_job,
    other_salt_job,
    plan_for,
    reference,
    refusal_job,
    train_sharded,
)

from manualpar.embeddings.planning import remapper_bytes_on_ranks
from manualpar.testing import run_distributed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch_sizes", [[5, 3], [4, 0, 6]], ids=["2_ranks", "3_ranks"])
@pytest.mark.parametrize(
    ("tables", "placement"),
    [(HASHED_TABLES, "row_wise"), *((MANAGED_TABLES, p) for p in PLACEMENTS)],
    ids=["hashed", *(f"managed_{p}" for p in PLACEMENTS)],
)
def test_raw_id_tables_match_the_reference(
    tables: tuple, placement: str, batch_sizes: list[int]
) -> None:
    """Managed tables: the same rows, remapper state and summed stats as one remapper."""
    per_rank = run_distributed(
        train_sharded, len(batch_sizes), args=(tables, batch_sizes, 1, placement), timeout=60
    )
    check_against_reference(per_rank, tables, batch_sizes)
    # the tables held by rows (whole or in blocks of buckets) went without the remap exchange
    if tables is MANAGED_TABLES:
        assert all(r["exchanged"] == EXCHANGED[placement] for r in per_rank)
        # what the planner counts per rank is what each rank holds
        plan = plan_for(tables, len(batch_sizes), placement)
        assert [r["held"] for r in per_rank] == remapper_bytes_on_ranks(plan, tables)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("before", "after"), [("exchange", "row_wise"), ("mixed", "at_owner")])
def test_managed_state_reshards_2_to_1_to_3_ranks(tmp_path: Path, before: str, after: str) -> None:
    """2 ranks train 2 steps and save; 1 rank loads and saves again; 3 ranks load, train a
    third step: every load holds the saved mapping, and the end is the reference's; also from
    tables remapped partly at their owner to tables all remapped at other owners."""
    first, second = str(tmp_path / "two"), str(tmp_path / "one")
    two = run_distributed(
        checkpoint_job, 2, args=(None, first, range(2), [5, 3], before), timeout=60
    )
    one = run_distributed(checkpoint_job, 1, args=(first, second, range(0), [0]), timeout=60)
    three = run_distributed(
        checkpoint_job, 3, args=(second, None, range(2, 3), [4, 0, 6], after), timeout=60
    )
    saved = two[0]["end"]
    check_state(one[0]["loaded"], saved, "loaded on 1 rank")
    for rank, result in enumerate(three):
        check_state(result["loaded"], saved, f"loaded on 3 ranks, rank {rank}")
    expected = reference(MANAGED_TABLES, [[5, 3], [5, 3], [4, 0, 6]])
    for rank, result in enumerate(three):
        check_state(result["end"], expected, f"after step 3, rank {rank}")


@pytest.mark.timeout(60)
def test_a_checkpoint_under_another_salt_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 writes the tables' record; every rank refuses the load alike, before any read."""
    path = str(tmp_path / "ckpt")
    checkpoint_job(None, path, range(1), [3])  # world size 1, in this process
    messages = run_distributed(other_salt_job, 2, args=(path,), timeout=30)
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"CheckpointMismatchError: checkpoint {path}, 'model': ")
    assert (
        "table 'm0': raw_ids=ManagedCollisions(policy='lru', salt=0, bucket_rows=4) in the "
        "checkpoint, raw_ids=ManagedCollisions(policy='lru', salt=7, bucket_rows=4) now"
    ) in messages[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("placement", ["exchange", "at_owner"])
def test_a_refused_batch_stops_every_rank_at_the_remap(placement: str) -> None:
    """The managed-collision exchange runs first (without one, the step's): the refusal
    travels there, nothing hangs."""
    messages = run_distributed(refusal_job, 2, args=(placement,), timeout=30)
    assert messages[0] == (
        "EmbeddingInputError: rank 1 refused its batch (the error is in that rank's log); "
        "every rank stops at this step. Fix the input on that rank"
    )
    assert messages[1].startswith(
        "EmbeddingInputError: feature 'plain' (table 'plain', 11 rows): id 11 at position 0"
    )


@pytest.mark.timeout(120)
def test_managed_tables_on_a_2d_mesh_match_the_reference() -> None:
    """2 replicas x 2 shards: the remapper spans the job, so both replicas use one mapping."""
    batch_sizes = [3, 2, 4, 1]
    per_rank = run_distributed(
        train_sharded, 4, args=(MANAGED_TABLES, batch_sizes, 2), timeout=90, local_world_size=2
    )
    check_against_reference(per_rank, MANAGED_TABLES, batch_sizes)
