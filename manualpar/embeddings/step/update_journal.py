"""Sparse updates kept undoable until the Trainer decides its step.

A Trainer step is dropped whole when any of its gradients is non-finite under "skip": a NaN in
a dense branch, or one micro-batch's NaN under gradient accumulation. But the fused update runs
inside each backward, so an earlier micro-batch's rows (and with accumulate=1, the step's own
finite rows when only the dense gradients are bad) have changed by the time the step is
decided. While a journal is open, each update first copies aside the rows it touches and their
optimizer state (rows_before.py) and keeps the step's slots pinned, so that no cache evicts a
row whose copy may still be written back; `undo()` restores them, last update first, with the
update count, and `keep()` lets them go. The Trainer opens one only where a step can be
dropped (some `non_finite="skip"`), so "raise" runs pay nothing; the copy is one gather of the
touched rows per backward.
"""

from __future__ import annotations

from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.results import SavedForBackward
from manualpar.embeddings.step.rows_before import RowsBefore, restore_rows, save_rows
from manualpar.embeddings.storage.tier import Pins

__all__ = ["UpdateJournal"]


class UpdateJournal:
    """The undo copies and pins of the updates since `open()` (see above)."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.is_open = False
        self._updates: list[list[RowsBefore]] = []
        self._pins: list[tuple[Pins, bool]] = []

    def open(self) -> None:
        """Keep the updates from now on undoable (until keep() or undo())."""
        self.keep()
        self.is_open = True

    def record(self, saved: SavedForBackward) -> None:
        """Before an update: copy aside what it will write (nothing when closed)."""
        if self.is_open:
            self._updates.append(save_rows(self.parts, saved))

    def forget_last(self) -> None:
        """The last recorded update was undone already (the half-row guard): not again."""
        if self.is_open and self._updates:
            self._updates.pop()

    def hold(self, pins: Pins, updated: bool) -> bool:
        """After an update: keep its slots pinned while open (True), else leave them to the
        caller (False)."""
        if not self.is_open:
            return False
        self._pins.append((list(pins), updated))
        pins.clear()
        return True

    def keep(self) -> None:
        """The updates stand: drop the copies and unpin the slots."""
        self._updates.clear()
        self._release()
        self.is_open = False

    def undo(self) -> int:
        """Put back every recorded update's rows, state and count, last first; how many."""
        undone = len(self._updates)
        for before in reversed(self._updates):
            restore_rows(self.parts, before)
        self.parts.optimizer.num_updates -= undone
        self._updates.clear()
        self._release()
        self.is_open = False
        return undone

    def _release(self) -> None:
        for pins, updated in self._pins:
            self.parts.stores.release(pins, updated=updated)
        self._pins.clear()
