"""The sharded sequence collection's output: each feature's rows cut from the pooled output, and
their gradients written back into one buffer of its shape, each element once.

The step's numerics against torch are in tests/unit/test_emb_sharded_sequence_one_process.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from manualpar.embeddings import SparseFeatures
from manualpar.embeddings.sharded.sequence_collection import split_rows

# batch of 2 samples: "a" 6 ids, "b" 3, "c" none; the pooled output has 6 bags (the largest)
FEATURES = SparseFeatures.from_dict(
    {"a": [[1, 2, 3], [4, 5, 6]], "b": [[1], [2, 3]], "c": [[], []]}
)
COUNTS = [6, 3, 0]
ROUTING = SimpleNamespace(
    features=[("a", "t"), ("b", "t"), ("c", "u")], feature_offsets=[0, 2, 4], dims=[2, 2, 1]
)


class _Written(TorchDispatchMode):
    """Elements written by the ops run inside it: every op's output but views and bare
    allocations (empty tensors are not written)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        allocation = func.overloadpacket in (torch.ops.aten.new_empty, torch.ops.aten.empty)
        if isinstance(out, torch.Tensor) and not func.is_view and not allocation:
            self.elements += out.numel()
        return out


def test_each_feature_gets_its_rows_and_columns_with_the_batch_lengths() -> None:
    pooled = torch.arange(30, dtype=torch.float64).view(6, 5)
    out = split_rows(pooled, FEATURES, COUNTS, ROUTING)  # type: ignore[arg-type]
    assert torch.equal(out["a"].values, pooled[:, 0:2])
    assert torch.equal(out["b"].values, pooled[:3, 2:4])
    assert out["c"].values.shape == (0, 1)
    assert out["b"].lengths.tolist() == [1, 2]


def test_the_output_gradient_is_written_once_not_zero_filled_per_feature() -> None:
    pooled = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    out = split_rows(pooled, FEATURES, COUNTS, ROUTING)  # type: ignore[arg-type]
    used = [out["a"].values, out["b"].values]  # "c" takes no part in the loss
    assert torch.equal(used[1], pooled[:3, 2:4].detach())
    grads = [torch.randn(6, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)]
    with _Written() as written:
        torch.autograd.backward(used, grads)
    expected = torch.zeros(6, 5, dtype=torch.float64)
    expected[:, 0:2], expected[:3, 2:4] = grads
    assert torch.equal(pooled.grad, expected)
    # a slice per feature wrote 105 elements here: a zero-filled (6, 5) or (3, 5) gradient per
    # slice, then their sum; one buffer writes each of the 30 once (padding and "c" as zeros)
    assert written.elements == pooled.numel()
