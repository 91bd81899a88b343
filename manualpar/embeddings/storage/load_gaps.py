"""What a checkpoint load leaves to fill in a disk table: the fields it did not write in the rows
it found never written.

A disk table's rows never written are not in its file (their reserved bytes read as zeros): they
are generated on first use. A load writes the fields it loads (weights, optimizer state) of every
row straight into the file, so making the block whole first, as a save does (every such row
generated and written), only to overwrite it, cost a 1 GB table 20 s of a 25 s load. A load
takes the block as it is (`loading()`), and the rows that were never written then hold the loaded
fields and, in the others, the reserved zeros. Those others get their initial values before
anything reads the rows (the next step, flush or checkpoint): the weights from the table's
initializer; an optimizer state unless it starts at zero, as the file then holds it already. A
load that was handed the block but never finished (it failed part way) may have written into
those rows: after it, every field not loaded is written, zeros included.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

__all__ = ["LoadGaps"]

Field = str | None  # an optimizer state's key, or None: the weights


@dataclass
class _Gaps:
    load: object  # the load's token (checkpoint.local_shards.loading)
    never: torch.Tensor  # by block row: never written before the load
    keys: set[Field]  # the fields the load has not written
    zeroed: bool  # the rows' other bytes are the reserved zeros (no failed load wrote there)


class LoadGaps:
    """One block's loads: which load holds views of its file, and what the last one left."""

    def __init__(self, fields: Collection[Field], initial: Mapping[str, torch.Tensor]) -> None:
        self.fields, self.initial = set(fields), initial
        self.pending: _Gaps | None = None
        self._handed: object | None = None  # the load given the file's views, until loaded
        self._leftovers = False  # a load given them never finished

    def handing_to(self, load: object) -> bool:
        """`load` gets views of the file (for every field). True the first time, when rows
        never written hold the reserved zeros unless `leftovers`."""
        first = self._handed is not load
        if self._handed not in (None, load):  # it failed after writing who knows which rows
            self._leftovers = True
        self._handed = load
        return first

    @property
    def leftovers(self) -> bool:
        """Whether a load given the file's views never finished (its writes are still there)."""
        return self._leftovers

    def loaded(self, load: object, keys: Collection[Field], never: torch.Tensor) -> None:
        """`load` wrote fields `keys` of every row; `never`: the rows never written before it
        (by block row), if this is its first report."""
        if self.pending is not None and self.pending.load is load:  # its next entry
            self.pending.keys -= set(keys)
        elif bool(never.any()):
            missing = self.fields - set(keys)
            self.pending = _Gaps(load, never, missing, zeroed=not self._leftovers)
        self.flushed()

    def flushed(self) -> None:
        """No view of the file is out, and no row is left as a failed load wrote it."""
        self._handed, self._leftovers = None, False

    def take(self, unless: object | None = None) -> tuple[torch.Tensor, list[Field]] | None:
        """(rows, fields) to set to their initial values now, unless the gaps are `unless`'s
        (a load still writing); None if there are none."""
        gaps = self.pending
        if gaps is None or (unless is not None and gaps.load is unless):
            return None
        self.pending = None
        keys = [
            key
            for key in gaps.keys
            if key is None or not gaps.zeroed or bool(self.initial[key].any())
        ]
        return (gaps.never, keys) if keys else None
