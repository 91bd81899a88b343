"""SparseFeatures.to: a batch already on the device is itself; a move keeps the validation done
when the batch was built (moving changes no id), with no host read."""

from __future__ import annotations

import torch

from manualpar.embeddings import SparseFeatures


def _batch() -> SparseFeatures:
    return SparseFeatures.from_dict({"a": [[1, 2], [], [3]], "b": [[4], [5, 6], [7]]})


def test_to_the_device_it_is_on_returns_the_batch_itself() -> None:
    batch = _batch()
    assert batch.to("cpu") is batch
    assert batch.to(torch.device("cpu")) is batch


def test_a_move_keeps_the_bags_without_validating_again() -> None:
    moved = _batch().to("meta")  # validation's host reads cannot run on meta tensors
    assert moved.keys == ("a", "b")
    assert moved.values.device.type == "meta" and moved.lengths.device.type == "meta"
    assert moved["b"].values.shape == (4,)
    assert moved.lengths.shape == (6,)
