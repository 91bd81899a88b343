"""Static routing of a plan: which rank serves which (feature, shard), in which order.

Every rank derives the same tables from the plan, so a step needs no metadata exchange beyond
batch sizes and id counts. A *route* is one feature looked up in one shard of its table. The
routes a rank serves are ordered by (its local shard, feature), so each sender's ids for one
local shard arrive contiguous and each shard does one lookup over all senders' bags. The step
routes its exchanges by it (step/), and the planner counts their bytes by it (planning/).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.plan import EmbeddingPlan, Shard

__all__ = ["LocalShard", "Route", "Routing"]


@dataclass(frozen=True)
class Route:
    feature: int  # index into Routing.features
    table: int  # index into Routing.tables
    row_group: int  # which block of rows (0 unless split by rows)
    shard: Shard

    @property
    def cols(self) -> int:
        return self.shard.cols


@dataclass(frozen=True)
class LocalShard:
    """A shard this rank holds, with the routes (one per feature of its table) it serves."""

    table: int
    shard: Shard
    features: tuple[int, ...]


class Routing:
    def __init__(self, tables: Sequence[EmbeddingBagConfig], plan: EmbeddingPlan, rank: int):
        self.tables = tuple(tables)
        self.plan = plan
        self.rank = rank
        self.world_size = plan.world_size
        # canonical feature order: tables in order, then each table's features
        self.features = tuple((f, t) for t, c in enumerate(tables) for f in c.feature_names)
        self.feature_index = {name: i for i, (name, _) in enumerate(self.features)}
        self.dims = [tables[t].embedding_dim for _, t in self.features]
        self.feature_offsets = [sum(self.dims[:i]) for i in range(len(self.dims))]
        self.total_dim = sum(self.dims)
        self.shards = [plan.shards(config) for config in tables]
        self.data_parallel = [
            t for t, c in enumerate(tables) if plan.tables[c.name].sharding == "data_parallel"
        ]
        self.row_starts = [sorted({s.row_start for s in shards}) for shards in self.shards]
        # each row start's group, by lookup: `row_starts[t].index(...)` per shard was ranks x
        # ranks work per row-split table (about 1 s a table at 8,192 ranks)
        group_of = [{start: g for g, start in enumerate(starts)} for starts in self.row_starts]
        self.routes_to: list[list[Route]] = [[] for _ in range(self.world_size)]
        for f, (_, t) in enumerate(self.features):
            if t in self.data_parallel:
                continue
            for shard in self.shards[t]:
                group = group_of[t][shard.row_start]
                self.routes_to[shard.rank].append(Route(f, t, group, shard))
        for routes in self.routes_to:
            routes.sort(key=lambda r: (r.table, r.shard.row_start, r.shard.col_start, r.feature))
        self.local_shards = self._local_shards()
        # per routed feature: its routes in (row group, column) order, for the senders
        self.routes_of_feature: list[list[tuple[int, Route]]] = [[] for _ in self.features]
        for dest, routes in enumerate(self.routes_to):
            for route in routes:
                self.routes_of_feature[route.feature].append((dest, route))
        self.row_start_tensors = [
            torch.tensor(starts, dtype=torch.int64) for starts in self.row_starts
        ]

    def _local_shards(self) -> list[LocalShard]:
        local: list[LocalShard] = []
        for t, shards in enumerate(self.shards):
            for shard in shards:
                if shard.rank == self.rank:
                    features = tuple(f for f, (_, ft) in enumerate(self.features) if ft == t)
                    local.append(LocalShard(t, shard, features))
        return local

    def routed_local_shards(self) -> list[LocalShard]:
        return [s for s in self.local_shards if s.table not in self.data_parallel]

    def splits_rows(self, table: int) -> bool:
        return len(self.row_starts[table]) > 1

    def splits_cols(self, table: int) -> bool:
        return any(s.cols != self.tables[table].embedding_dim for s in self.shards[table])
