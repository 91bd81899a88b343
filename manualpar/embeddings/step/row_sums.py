"""How a step's summed row gradients reach the fused update: directly, or first summed over the
replicas of a 2-D collection (replica_combine.py). Chosen once per collection, so the update
phase has no branch for it."""

from __future__ import annotations

from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.replica_combine import RowGradients, combine_replicas
from manualpar.embeddings.step.routing import LocalShard

__all__ = ["RowSumUpdate", "row_sum_update"]

RowSums = list[tuple[LocalShard, RowGradients]]  # per local shard: (distinct rows, summed)


class RowSumUpdate:
    """Apply each shard's summed row gradients with the fused optimizer's rule."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    def combine(self, sums: list[RowGradients]) -> list[RowGradients]:
        return sums

    def __call__(self, updates: RowSums) -> None:
        parts = self.parts
        summed = self.combine([rows_and_sums for _, rows_and_sums in updates])
        for (shard, _), (rows, sums) in zip(updates, summed, strict=True):
            parts.optimizer.update_rows(
                parts.name(shard.table), parts.weight(shard.table), rows, sums
            )


class ReplicaCombinedUpdate(RowSumUpdate):
    """2-D tables: every replica's row sums are added up over the replicate dim first, so each
    replica applies the whole job's gradient to the same rows."""

    def combine(self, sums: list[RowGradients]) -> list[RowGradients]:
        replicate = self.parts.mesh.replicate
        assert replicate is not None  # only chosen when the mesh combines replicas
        return combine_replicas(self.parts.strategy, replicate, sums)


def row_sum_update(parts: StepParts) -> RowSumUpdate:
    combines = parts.mesh.replicate is not None and parts.mesh.combines
    return ReplicaCombinedUpdate(parts) if combines else RowSumUpdate(parts)
