"""disk_hit_bounds.py's policies and bounds on a stream small enough to follow by hand: two
slots, rows 0 and 1 used, then row 2, then 0 again, then 1 again (one row a call)."""

from __future__ import annotations

import sys
from types import ModuleType

import numpy as np
import pytest
from example_modules import EXAMPLES

BENCHMARKS = EXAMPLES / "benchmarks"
STREAM = [[np.array([0]), np.array([1])], [np.array([2]), np.array([], dtype=np.int64)]] + [
    [np.array([row]), np.array([], dtype=np.int64)] for row in (0, 1)
]


@pytest.fixture
def bounds() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import disk_hit_bounds
    finally:
        sys.path.remove(str(BENCHMARKS))
    return disk_hit_bounds


def test_belady_beats_lru_and_static_knows_the_counts(bounds: ModuleType) -> None:
    # LRU evicts row 0 for row 2 (ties: the lower slot), then row 1 for row 0: 5 calls, no hit
    assert bounds.run_cache(STREAM, 4, 2, "lru", 0) == 0.0
    # MIN evicts row 1 (used again last) for row 2, so row 0 hits
    assert bounds.belady(STREAM, 4, 2, 0) == pytest.approx(1 / 5)
    # one slot kept for the most used row (0 or 1), one for a step's rows: 2 hits of 5
    assert bounds.static(STREAM, 4, 2, 0) == pytest.approx(2 / 5)
