"""A step's touched rows as they were before its update, so that the update can be undone.

The fused update writes rows and their optimizer state in place, inside backward; nothing else
could undo it. Copying aside the rows a step touches (a gather of its slots) and writing them
back is the undo both the half-row guard (half_overflow.py) and a dropped Trainer step
(update_journal.py) use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.results import SavedForBackward

__all__ = ["RowsBefore", "restore_rows", "save_rows"]


@dataclass
class RowsBefore:
    """One block's touched rows (slots) as they were before the update, with their state."""

    table: int
    half: bool  # checked after the update by the half-row guard (others are only restored)
    slots: torch.Tensor  # may repeat: a row touched twice is saved twice, identically
    rows: torch.Tensor
    state: dict[str, torch.Tensor]


def save_rows(
    parts: StepParts, saved: SavedForBackward, half: frozenset[int] = frozenset()
) -> list[RowsBefore]:
    """Copy aside this rank's rows the step's update may write, and their optimizer state
    (frozen tables are not updated: nothing to copy)."""
    routing = parts.routing
    local = routing.routed_local_shards()
    batch = saved.batch  # every table's bags in one batch (batched_tables.py)
    touched: list[tuple[int, torch.Tensor]] = (
        [(shard.table, batch.table_ids(k)) for k, shard in enumerate(local)]
        if batch is not None
        else [(shard.table, bags.ids) for shard, bags in zip(local, saved.bags, strict=True)]
    )
    for t in routing.data_parallel:  # small by construction: the whole copy
        touched.append((t, torch.arange(parts.weight(t).shape[0], device=parts.device)))
    before = []
    for t, slots in touched:
        if t in saved.frozen or slots.numel() == 0:
            continue
        state = parts.optimizer.table_state[parts.name(t)]
        before.append(
            RowsBefore(
                t,
                t in half,
                slots,
                parts.weight(t).index_select(0, slots),
                {key: value.index_select(0, slots) for key, value in state.items()},
            )
        )
    return before


def restore_rows(parts: StepParts, before: list[RowsBefore]) -> None:
    """Write the saved rows and state back (the update count is the caller's)."""
    with torch.no_grad():
        for saved in before:
            parts.weight(saved.table).index_copy_(0, saved.slots, saved.rows)
            state = parts.optimizer.table_state[parts.name(saved.table)]
            for key, value in saved.state.items():
                state[key].index_copy_(0, saved.slots, value)
