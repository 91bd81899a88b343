"""The Trainer's checkpoint record (checkpoint/records.py): what gives a saved step its meaning.

Data is addressed by step: step s trains on micro-batches s * accumulate ... and each index
names the samples of a global batch of the data's size. A resume under another global batch
(the data's batch times `accumulate`) reads other samples from the same step on, skipping some
and repeating others, with no error. The record holds the global batch and how the run was
seeded; a resume with another global batch is refused unless `allow_batch_change=True` (a
planned batch-size schedule). The data's batch is known when the data says it
(`data.global_batch_size`, which `dataset_batches` sets); else only `accumulate` is compared.
Another seed mode is only logged: every rank's RNG state is restored from the checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

from manualpar.errors import CheckpointMismatchError
from manualpar.seed import current_seeding

__all__ = ["RunRecord"]

log = logging.getLogger("manualpar.trainer")


class RunRecord:
    """A Trainer state entry of the "record" kind: saved in the manifest, checked on resume."""

    def __init__(self, data: Any, accumulate: int, allow_batch_change: bool) -> None:
        batch = getattr(data, "global_batch_size", None)
        self.batch = batch if isinstance(batch, int) and not isinstance(batch, bool) else None
        self.accumulate, self.allow_batch_change = accumulate, allow_batch_change

    def checkpoint_record(self) -> dict[str, Any]:
        seeding = current_seeding()
        return {
            "global_batch": None if self.batch is None else self.batch * self.accumulate,
            "data_batch": self.batch,
            "accumulate": self.accumulate,
            "seed": None
            if seeding is None
            else {"seed": seeding.seed, "per_rank": seeding.per_rank},
        }

    def check_checkpoint_record(self, saved: dict[str, Any], where: str) -> None:
        self._check_batch(saved, where)
        mine = self.checkpoint_record()["seed"]
        if saved.get("seed") is not None and mine is not None and saved["seed"] != mine:
            log.warning(
                "%s: the run was seeded with %s, this one with %s; every rank's RNG state is "
                "restored from the checkpoint, so the run continues its own streams",
                where,
                _seeding(saved["seed"]),
                _seeding(mine),
            )

    def _check_batch(self, saved: dict[str, Any], where: str) -> None:
        mine = self.checkpoint_record()
        if saved.get("global_batch") is not None and mine["global_batch"] is not None:
            key = "global_batch"  # known on both sides: the split into accumulate may change
        elif saved.get("accumulate") is not None:
            key = "accumulate"  # the data's batch unknown on a side: what is left to compare
        else:
            return
        if saved[key] == mine[key]:
            return
        change = f"{_batch(saved)} in the checkpoint, {_batch(mine)} now"
        if self.allow_batch_change:
            log.warning("%s: the global batch changes: %s (allow_batch_change=True)", where, change)
            return
        raise CheckpointMismatchError(
            f"{where}: the global batch differs: {change}. Data is addressed by step, so "
            "from this step on the run would read other samples than the one it resumes "
            "(skipping some, repeating others). Resume with the checkpoint's batch and "
            "accumulate, start a new run (another out_dir), or pass "
            "Trainer(allow_batch_change=True) if the change is planned (a batch-size schedule)"
        )


def _batch(record: dict[str, Any]) -> str:
    """'64 samples a step (data batch 32 x accumulate 2)', or 'accumulate 2' if the data's batch
    is unknown."""
    if record.get("global_batch") is None:
        return f"accumulate {record.get('accumulate')} (data batch unknown)"
    return (
        f"{record['global_batch']} samples a step (data batch {record.get('data_batch')} x "
        f"accumulate {record.get('accumulate')})"
    )


def _seeding(seed: dict[str, Any]) -> str:
    per_rank = ", per_rank=True" if seed.get("per_rank") else ""
    return f"seed_everything({seed.get('seed')}{per_rank})"
