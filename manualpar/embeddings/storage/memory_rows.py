"""MemoryRows: a table block held whole in memory, the tier every table has by default.

Slot i is row i, so a step maps nothing and pins nothing, and a checkpoint reads the weight and
state tensors themselves (one chunk each).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import torch

__all__ = ["MemoryRows"]


class MemoryRows:
    """A RowStore (tier.py) over the block's weight and its optimizer state tensors."""

    def __init__(self, weight: torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
        self.weight, self.state = weight, state

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
