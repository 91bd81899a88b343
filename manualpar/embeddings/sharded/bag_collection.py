"""ShardedEmbeddingBagCollection: this rank's blocks of the tables, their fused optimizer and
the sharded step (step/) that looks them up in forward and updates them in backward.

Built by `shard_embeddings` (sharded/shard_embeddings.py) on the parts of ShardedTables
(sharded/sharded_tables.py); its batches are the bags themselves, its output the pooled rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from manualpar.eager import eager_only
from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.modules.bag_collection import EmbeddingBagCollection, PooledEmbeddings
from manualpar.embeddings.optim.update_rules import UpdateRule
from manualpar.embeddings.plan import EmbeddingPlan
from manualpar.embeddings.sharded.batch_inputs import pooled_bags
from manualpar.embeddings.sharded.sharded_tables import ShardedTables
from manualpar.embeddings.step.table_mesh import TableMesh
from manualpar.embeddings.storage.disk_tier import DiskTier

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["ShardedEmbeddingBagCollection"]


class ShardedEmbeddingBagCollection(ShardedTables):
    """What `shard_embeddings` returns for an EmbeddingBagCollection: this rank's shards, the
    sharded step (forward returns PooledEmbeddings) and `fused_optimizer`; build it through
    `shard_embeddings`, not directly. `plan` and `configs` describe it:
    `print(emb.plan.describe(emb.configs))`. Its checkpoint record (TableRecords) refuses a
    checkpoint of tables with other rows, dim or raw-id setting."""

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        strategy: ManualParallelStrategy,
        plan: EmbeddingPlan,
        rule: UpdateRule,
        normalize_by: str,
        layout: TableMesh | None = None,
        disk_tier: DiskTier | None = None,
        non_finite: str = "raise",
    ) -> None:
        super().__init__(
            ebc,
            strategy,
            plan,
            rule,
            normalize_by,
            layout,
            disk_tier,
            non_finite,
            shape=pooled_bags(ebc.configs),
        )

    # A deliberate graph break under torch.compile: the lookup runs eagerly between compiled
    # dense graphs. Its exchange sizes are known only at run time (host syncs, no CUDA graph
    # capture either way) and its backward updates tables in place, which an opaque custom op
    # would have to hide from the compiler (docs/embeddings-training.md, "torch.compile").
    @eager_only(f"{BUILDER}: the table exchange runs eagerly")
    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        pooled = self.lookup(self.inputs.prepare(features))
        return PooledEmbeddings(pooled, self.feature_names, tuple(self.routing.dims))
