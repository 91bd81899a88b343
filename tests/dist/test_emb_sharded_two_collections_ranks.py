"""Two collections planned together (`plan_collections` with the strategy) and sharded on 2
ranks train exactly as one unsharded collection of all their tables."""

from __future__ import annotations

import pytest
from embedding_cases import assert_close, reference
from two_tower_cases import TOWERS, train_two_towers

from manualpar.embeddings.planning import plan_collections
from manualpar.testing import run_distributed


@pytest.mark.timeout(120)
def test_two_towers_planned_together_match_the_reference_on_2_ranks() -> None:
    batch_sizes = [5, 3]
    per_rank = run_distributed(train_two_towers, 2, args=(batch_sizes, "rowwise"))
    expected_plans = plan_collections(TOWERS, 2, replicate_bytes=0)
    ranks_used = set()
    for rank, got in enumerate(per_rank):
        assert got["plans"] == {n: p.to_dict() for n, p in expected_plans.items()}, rank
    for name, plan in expected_plans.items():
        ranks_used |= {s.rank for config in TOWERS[name] for s in plan.shards(config)}
    assert ranks_used == {0, 1}  # the towers' tables spread over both ranks
    ref_first, ref_tables, ref_state = reference("rowwise", batch_sizes)
    for rank, got in enumerate(per_rank):
        assert_close(got["first"], ref_first[rank], f"rank {rank}: step-0 output")
        for name, expected in ref_tables.items():
            assert_close(got["tables"][name], expected, f"rank {rank}: table {name}")
            assert_close(got["state"][name]["sum"], ref_state[name]["sum"], f"{name} state")
