"""Two tiny tables and a good batch over them, for the embeddings tests that need a small
collection (the error tests, one-process checks), and `raises` for their exact messages.

`user`: 10 rows x 4, looked up by feature user; `item`: 5 rows x `item_dim`, looked up by the
features item and last_item (one table, two features).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from manualpar.embeddings import EmbeddingBagConfig, SparseFeatures

GOOD = {"user": [[1], [2, 3]], "item": [[0], [4]], "last_item": [[2], []]}


def tiny_tables(kind: type[EmbeddingBagConfig] = EmbeddingBagConfig, item_dim: int = 4) -> tuple:
    """(user, item) configs of `kind` (EmbeddingBagConfig, or EmbeddingConfig for sequences)."""
    return (
        kind("user", 10, 4),
        kind("item", 5, item_dim, feature_names=("item", "last_item")),
    )


def good_batch(**changes: list[list[int]]) -> SparseFeatures:
    """GOOD with some features replaced."""
    return SparseFeatures.from_dict({**GOOD, **changes})


def raises(error: type[Exception], *parts: str) -> Any:
    """pytest.raises matching every literal fragment of the message, in order."""
    return pytest.raises(error, match=".*".join(re.escape(p) for p in parts))
