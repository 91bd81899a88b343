"""The placements the cost planner weighs for one table, given how busy each rank already is:
replicated, whole on one of the least-busy ranks, rows over all ranks, over one of the
least-busy nodes or over the least-busy 2 to 64 nodes, columns over the least-busy 2 to 32
ranks, and on disk with a DiskTier."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.plan import (
    TablePlacement,
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from manualpar.embeddings.planning.topology import Topology
from manualpar.embeddings.storage.cached_tier import CachedTier

__all__ = ["COST_REPLICATE_BYTES", "candidates"]

LEAST_BUSY = 4  # ranks (and nodes) tried for a whole table or a node's row split
# Replication is a candidate up to this size (weights + state): the model weighs its gradient
# all_reduce against the exchanges it saves (the memory-only planner stops at 256 KiB)
COST_REPLICATE_BYTES = 64 * 2**20
# Every block of a table returns a pooled row per bag of the job (a row split too, whatever
# its rows), so on hundreds of ranks a table's owners serve the whole global batch: only a
# column split shrinks what each sends, and 8 blocks of a 128-wide table left its owners 4x
# the median rank at 1,024 ranks (32 blocks: within 2%). The model prices the ids every block
# receives, so it, not a fixed width, judges how narrow a block pays
COLUMN_SPLITS = (2, 4, 8, 16, 32)
MIN_COLUMNS = 4  # one float32 block row in a 16-byte vector at least
# A row block returns only the bags with an id in its rows (step/exchange.py), so a split over
# more ranks sends fewer rows each, but every block still takes every bag's length: on 1,024
# ranks the Criteo 1TB tables over 8 nodes each left the slowest rank 1.2x the median (whole
# on one rank: 27x); over all ranks, every table's lengths reach every rank
NODE_GROUPS = (2, 4, 8, 16, 32, 64)
SORT_ALL = 2048  # up to this many ranks, least_busy sorts them all (quicker than selecting)


def least_busy(values: torch.Tensor, count: int) -> list[int]:
    """The `count` smallest values' indices, ties to the lower index (a stable sort's first)."""
    if values.numel() <= SORT_ALL:
        return torch.argsort(values, stable=True)[:count].tolist()
    # with thousands of ranks, select, then sort the few: a full sort per candidate list
    # took most of a plan's time
    kth = torch.topk(values, count, largest=False).values.max()
    below = (values < kth).nonzero().flatten()
    below = below[torch.argsort(values[below], stable=True)]
    ties = (values == kth).nonzero().flatten()[: count - below.numel()]
    return torch.cat([below, ties]).tolist()


def candidates(
    config: EmbeddingBagConfig,
    size: int,
    topology: Topology,
    busy: torch.Tensor,
    replicate_bytes: int,
    disk_tier: CachedTier | None,
) -> Iterator[TablePlacement]:
    world, per_node = topology.world_size, topology.ranks_per_node
    if world > 1 and size <= replicate_bytes:
        yield data_parallel()
    for rank in least_busy(busy, LEAST_BUSY):
        yield table_wise(rank)
    if world > 1 and config.num_embeddings >= world:
        yield row_wise()
    if disk_tier is not None and config.num_embeddings >= world:
        yield row_wise(on_disk=True)
    nodes = topology.nodes
    if nodes > 1 and config.num_embeddings >= per_node:
        node_busy = busy.view(nodes, per_node).amax(dim=1)  # (max(dim=) also finds indices)
        for node in least_busy(node_busy, LEAST_BUSY):
            yield table_row_wise(node, per_node)
        for group in NODE_GROUPS:
            if group < nodes and config.num_embeddings >= group * per_node:
                chosen = sorted(least_busy(node_busy, group))
                yield row_wise([n * per_node + r for n in chosen for r in range(per_node)])
    for split in COLUMN_SPLITS:
        if split <= world and config.embedding_dim // split >= MIN_COLUMNS:
            yield column_wise(sorted(least_busy(busy, split)))
