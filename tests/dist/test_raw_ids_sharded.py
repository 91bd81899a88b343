"""Raw-id tables sharded over 2 and 3 gloo ranks give the pooled outputs and trained tables of
the single-process reference (world size 1: tests/unit/test_raw_ids_single.py)."""

from __future__ import annotations

import pytest
from raw_id_cases import HASHED_TABLES, check_against_reference, train_sharded

from manualpar.testing import run_distributed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch_sizes", [[5, 3], [4, 0, 6]], ids=["2_ranks", "3_ranks"])
def test_hashed_tables_match_the_reference(batch_sizes: list[int]) -> None:
    per_rank = run_distributed(
        train_sharded, len(batch_sizes), args=(HASHED_TABLES, batch_sizes), timeout=60
    )
    check_against_reference(per_rank, HASHED_TABLES, batch_sizes)
