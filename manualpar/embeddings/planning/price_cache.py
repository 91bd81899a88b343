"""Priced candidates kept for reuse across the search's passes, within a memory bound.

The search asks for the same (table, placement, dtype) many times (the greedy, each bisection
step of tighten, refine and the notes); pricing a split over many ranks builds a block per
rank, so those costs are kept, and the others while the kept ones take under CACHE_BYTES.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.plan import TablePlacement
from manualpar.embeddings.planning.block_costs import DiskBlocks
from manualpar.embeddings.planning.cost_model import placement_costs
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.planning.topology import Topology
from manualpar.embeddings.planning.workload import Workload
from manualpar.embeddings.storage.cached_tier import CachedTier

__all__ = ["CACHE_BYTES", "KEEP_BLOCKS", "PriceCache"]

# Candidates' costs kept for reuse across the passes, beyond those of splits over more than
# KEEP_BLOCKS ranks (always kept: one or two a table); the rest are recomputed when asked again
CACHE_BYTES = 256 * 2**20
KEEP_BLOCKS = 64


class PriceCache:
    """Each table's costs per rank in a placement and dtype, priced by cost_model.py on
    `topology` (`group`: one shard group's, the plan's ranks) for `workload`."""

    def __init__(
        self,
        tables: Mapping[str, EmbeddingBagConfig],
        topology: Topology,
        workload: Workload,
        disk_tier: CachedTier | None,
        replicas: int,
        group: Topology,
        shared_with: DiskBlocks | None = None,
    ) -> None:
        self.tables, self.topology, self.workload = tables, topology, workload
        self.disk_tier, self.replicas, self.group = disk_tier, replicas, group
        self.shared_with = shared_with  # the disk blocks sharing each rank's cache (pinned)
        self._cache: dict[tuple[str, TablePlacement, torch.dtype], RankCosts] = {}
        self._cached_bytes = 0

    def costs(self, key: str, placement: TablePlacement, dtype: torch.dtype) -> RankCosts:
        config = self.tables[key]
        found = self._cache.get((key, placement, dtype))
        if found is None:
            found = placement_costs(
                config if dtype == config.dtype else replace(config, dtype=dtype),
                placement,
                self.topology,
                self.workload,
                self.disk_tier,
                key,
                self.replicas,
                shared_with=self.shared_with,
            )
            if self._keeps(placement, found):
                self._cache[(key, placement, dtype)] = found
        return found

    def _keeps(self, placement: TablePlacement, costs: RankCosts) -> bool:
        """Whether to keep a candidate's costs for reuse: while the kept ones take under
        CACHE_BYTES, and always for a split over many ranks (costing it builds a block per
        rank). Costs are world-size tensors: keeping every candidate's grew with tables x ranks
        x the candidates the passes try (over 8 GB for 1,000 tables on 2,000 ranks)."""
        size = costs.nbytes
        blocks = len(placement.ranks) or (
            self.group.world_size if placement.sharding == "row_wise" else 1
        )
        if blocks <= KEEP_BLOCKS and self._cached_bytes + size > CACHE_BYTES:
            return False  # recomputed when asked again: the same numbers, some time
        self._cached_bytes += size
        return True
