"""MemoryRows: a table block held whole in memory, the tier every table has by default.

Slot i is row i, so a step maps nothing and pins nothing, and a checkpoint reads the weight and
state tensors themselves (one chunk each): the weight where the table module holds it when the
checkpoint reads it, so a weight replaced by one of the same shape and dtype (a new Parameter,
new data under the same one) is the one saved and loaded into.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from manualpar.embeddings.config import BUILDER
from manualpar.errors import BuilderError

__all__ = ["MemoryRows", "replaced_weight_error"]


def replaced_weight_error(
    table: str, now: torch.Tensor, shape: torch.Size, dtype: torch.dtype, why: str
) -> BuilderError:
    """The error for a block's weight replaced by one of another shape or dtype (`table`: its
    name as the message shows it, e.g. with its rank; `why`: what would go wrong, from its
    separator on); the step's check (step/weight_guard.py) and a checkpoint's read raise it."""
    rows, cols = shape
    return BuilderError(
        f"{BUILDER}: table {table}: its weight was replaced by a "
        f"{' x '.join(map(str, now.shape))} {now.dtype} tensor, but this rank's block is "
        f"{rows} x {cols} {dtype}{why}. Write new rows into the block in place "
        "(`weight.data.copy_(rows)`, or load a checkpoint), or build the collection again with "
        f"{BUILDER}() for another shape or dtype"
    )


class MemoryRows:
    """A RowStore (tier.py) over the block's weight and its optimizer state tensors."""

    def __init__(self, table: nn.Module, state: Mapping[str, torch.Tensor], name: str) -> None:
        """`table`: the module holding the block's weight (as `weight`) of table `name`."""
        self.table, self.state, self.name = table, state, name
        weight = table.weight
        assert isinstance(weight, torch.Tensor)
        self._block = (weight.shape, weight.dtype)  # the rows and dtype of the state's rows
        self._device = weight.device  # where the state and the step's buffers live

    @property
    def weight(self) -> torch.Tensor:
        """The block's weight as the table holds it now (detached: a load copies into it)."""
        weight = self.table.weight
        assert isinstance(weight, torch.Tensor)
        if (weight.shape, weight.dtype) != self._block:
            raise replaced_weight_error(
                repr(self.name),
                weight,
                *self._block,
                ": a checkpoint would save or load part of the table",
            )
        if weight.device != self._device:
            raise BuilderError(
                f"{BUILDER}: table {self.name!r}: its weight was moved from {self._device} to "
                f"{weight.device}, but this rank's block and its optimizer state are on "
                f"{self._device}: a checkpoint would save or load the rows apart from their state. "
                f"Move it back (`.to({str(self._device)!r})`), or build the collection again with "
                f"{BUILDER}() on a strategy of the new device"
            )
        return weight.detach()

    def begin_step(self) -> None:
        pass

    def to_slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return ids, None

    def release(self, pinned: torch.Tensor, updated: bool) -> None:
        pass

    @property
    def reads_rows(self) -> bool:
        return False

    @property
    def slot_rows(self) -> torch.Tensor | None:
        return None

    def checkpoint_chunks(self, key: str | None) -> list[tuple[int, torch.Tensor]]:
        return [(0, self.weight if key is None else self.state[key])]

    def load_writer(
        self, key: str | None, start: int
    ) -> Callable[[Sequence[int], torch.Tensor], None] | None:
        return None  # a load copies into the tensors themselves

    def loaded(self, keys: Collection[str | None]) -> None:
        pass

    @property
    def spill_dir(self) -> Path | None:
        return None

    def drop_pages(self) -> None:
        pass
