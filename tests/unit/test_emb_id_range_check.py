"""check_features' one-pass id-range check over every table of a batch (modules/bag_collection.py)
gives the per-table check's answer: the first feature (in the tables' order) holding a bad id
raises, naming its table, id, position and sample; raw-id tables take any int64."""

from __future__ import annotations

import pytest
import torch

from manualpar.embeddings import EmbeddingBagConfig, HashIds, SparseFeatures
from manualpar.embeddings.modules.bag_collection import check_features
from manualpar.errors import EmbeddingInputError

I64 = torch.iinfo(torch.int64)
TABLES = (
    EmbeddingBagConfig("a", 10, 4, feature_names=("fa",)),
    EmbeddingBagConfig("raw", 7, 4, feature_names=("fr",), raw_ids=HashIds(salt=1)),
    EmbeddingBagConfig("b", 3, 4, feature_names=("fb", "fb2")),
)


def _batch(fa: list[int], fr: list[int], fb: list[int], fb2: list[int]) -> SparseFeatures:
    """Two samples: each feature's first id in sample 0, the rest in sample 1."""
    ids = [fa, fr, fb, fb2]
    lengths = [n for f in ids for n in (min(len(f), 1), max(len(f) - 1, 0))]
    values = torch.tensor([i for f in ids for i in f], dtype=torch.int64)
    return SparseFeatures(("fa", "fr", "fb", "fb2"), values, torch.tensor(lengths))


def test_valid_ids_of_tables_of_different_sizes_pass_and_raw_ids_take_any_int64() -> None:
    batch = _batch([9, 0], [I64.min, I64.max, -5, 99], [2, 2, 0], [])
    assert check_features(batch, TABLES) is batch


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        # within the largest table's rows but past its own: the smaller table's error
        (
            ([1], [], [1, 5], []),
            "feature 'fb' (table 'b', 3 rows): id 5 at position 1 of the feature's ids "
            "(sample 1) is out of range; ids must be in [0, 3)",
        ),
        # the first feature in the tables' order raises, not the one with the larger id
        (
            ([1, 10], [], [1, 50], []),
            "feature 'fa' (table 'a', 10 rows): id 10 at position 1",
        ),
        # a negative id after a raw-id feature holding negatives
        (
            ([1], [-4, -9], [0], [2, -1, 3]),
            "feature 'fb2' (table 'b', 3 rows): id -1 at position 1 of the feature's ids "
            "(sample 1) is negative",
        ),
        # the int64 limits in a checked table
        (([I64.max], [], [], []), f"feature 'fa' (table 'a', 10 rows): id {I64.max} at"),
        (([0], [], [I64.min], []), f"feature 'fb' (table 'b', 3 rows): id {I64.min} at"),
    ],
)
def test_the_first_feature_with_a_bad_id_raises_the_per_table_error(
    ids: tuple[list[int], ...], message: str
) -> None:
    with pytest.raises(EmbeddingInputError) as raised:
        check_features(_batch(*ids), TABLES)
    assert message in str(raised.value)


def test_a_batch_in_another_key_order_is_checked_after_its_reorder() -> None:
    batch = _batch([1], [3], [7], [0])
    swapped = batch.select(("fb", "fa", "fr", "fb2"))
    with pytest.raises(EmbeddingInputError, match=r"feature 'fb' .* id 7 at position 0"):
        check_features(swapped, TABLES)
