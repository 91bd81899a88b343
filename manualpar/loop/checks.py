"""check_finite: an opt-in guard that stops a NaN or inf at the tensor that brought it in.

A NaN in the inputs spreads silently through every later step (and through all-reduce, to every
rank). Checking costs a pass over the data and, on a GPU, a host sync, so it is never done
implicitly: call it where you want the guarantee, typically on each batch and on the loss.

    mp.check_finite(batch, where="batch")          # tensors, or dicts/lists/tuples of them
    mp.check_finite(loss, where=f"loss at step {step}")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch

from manualpar.errors import NonFiniteError

__all__ = ["check_finite"]

T = TypeVar("T")


def check_finite(value: T, where: str = "tensor") -> T:
    """Return `value` unchanged if every floating tensor in it is finite, else raise
    NonFiniteError naming the tensor (`where` plus its key path), the number of NaN and inf
    values and the first bad index. Tensors inside dicts, lists, tuples and dataclasses (such as
    SparseFeatures' weights) are checked; integer tensors and other leaves are skipped."""
    for name, tensor in _floating_tensors(value, where):
        finite = torch.isfinite(tensor)
        if bool(finite.all()):
            continue
        nans = int(torch.isnan(tensor).sum())
        infs = int((~finite).sum()) - nans
        first = tuple(int(i) for i in torch.nonzero(~finite)[0]) if tensor.dim() else ()
        bad = tensor[first].item() if tensor.dim() else tensor.item()
        raise NonFiniteError(
            f"{name}: {nans + infs} non-finite value(s) ({nans} NaN, {infs} inf) in a "
            f"{tensor.dtype} tensor of shape {tuple(tensor.shape)}; the first is {bad} at index "
            f"{first}. Fix or drop this input before it reaches the model (a NaN loss usually "
            "means a NaN input or too high a learning rate)"
        )
    return value


def _floating_tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield name, value.detach()
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _floating_tensors(item, f"{name}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _floating_tensors(item, f"{name}[{index}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # e.g. SparseFeatures
        for field in dataclasses.fields(value):
            yield from _floating_tensors(getattr(value, field.name), f"{name}.{field.name}")
