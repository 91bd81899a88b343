"""One table block's costs on its owner, the pieces cost_model.py adds up per placement: the
all-to-all traffic of owners serving every rank, the distinct rows a block's lookups touch, its
memory, lookups, updates and disk IO (the disk tier priced through its cache, storage/
cached_tier.py), and a replicated table's copy and all_reduce."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from manualpar.embeddings.config import STATE_BYTES, EmbeddingBagConfig
from manualpar.embeddings.plan import EmbeddingPlan, TablePlacement
from manualpar.embeddings.planning.popularity import distinct_rows
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.planning.workload import Workload
from manualpar.embeddings.storage.cached_tier import CachedTier

__all__ = [
    "FLOAT32",
    "INT64",
    "DiskBlocks",
    "block_work",
    "disk_blocks",
    "distinct",
    "owner_traffic",
    "replicated",
    "state_bytes",
    "state_widths",
]

INT64, FLOAT32 = 8, 4

# Each rank's disk blocks, {table: (block rows, bytes per row)}: what its cache is shared by
DiskBlocks = Sequence[Mapping[str, tuple[int, int]]]


def disk_blocks(
    placed: Mapping[str, tuple[EmbeddingBagConfig, TablePlacement]],
    world: int,
    workload: Workload,
) -> list[dict[str, tuple[int, int]]]:
    """The disk blocks each rank holds of the tables `placed` ({key: (config, placement)}),
    as the storage splits its cache over them (sharded/table_storage.py)."""
    held: list[dict[str, tuple[int, int]]] = [{} for _ in range(world)]
    for key, (config, placement) in placed.items():
        if not placement.on_disk:
            continue
        row_state, col_state = state_widths(workload.rule(key)[0])
        for shard in EmbeddingPlan(world, {config.name: placement}).shards(config):
            width = shard.cols * config.dtype.itemsize
            width += (row_state + col_state * shard.cols) * STATE_BYTES
            held[shard.rank][key] = (shard.rows, width)
    return held


def owner_traffic(
    costs: RankCosts, to_owner: torch.Tensor, from_owner: torch.Tensor, per_node: int
) -> None:
    """Add all-to-all traffic where every rank sends `to_owner[o]` bytes to each other rank o and
    each rank o sends `from_owner[o]` bytes to every other rank (uniform batches)."""
    world = to_owner.numel()
    node_of = torch.arange(world) // per_node
    nodes = world // per_node

    def node_sums(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(nodes, dtype=torch.float64).index_add_(0, node_of, values)[node_of]

    for send, receive in ((to_owner, "to"), (from_owner, "from")):
        on_my_node = node_sums(send) - send  # what my node's other ranks take or give each
        elsewhere = send.sum() - node_sums(send)
        if receive == "to":  # I send to the others; each other rank sends `send[me]` to me
            costs.sent_intra += on_my_node
            costs.sent_inter += elsewhere
            costs.received_intra += send * (per_node - 1)
            costs.received_inter += send * (world - per_node)
        else:  # I send `send[me]` to each other rank; each other rank sends me its own
            costs.sent_intra += send * (per_node - 1)
            costs.sent_inter += send * (world - per_node)
            costs.received_intra += on_my_node
            costs.received_inter += elsewhere


def distinct(
    lookups: torch.Tensor, rows: torch.Tensor, table_rows: int, skew: float
) -> torch.Tensor:
    """Expected distinct rows a step touches in each block (`rows[i]` of a `table_rows` table,
    serving `lookups[i]` ids): the popular rows are spread over the blocks (ids are scattered by
    the remap or the data), so a block sees its share of the table's distinct rows."""
    share = rows / table_rows
    return share * distinct_rows(lookups / share.clamp(min=1e-30), table_rows, skew)


def state_bytes(state: Mapping[str, bool], cols: torch.Tensor) -> torch.Tensor:
    row_state, col_state = state_widths(state)
    return (row_state + col_state * cols) * STATE_BYTES


def state_widths(state: Mapping[str, bool]) -> tuple[int, int]:
    """(state floats per row, state floats per element) of an update rule's STATE."""
    per_row = sum(1 for whole_row in state.values() if whole_row)
    return per_row, len(state) - per_row


def block_work(
    costs: RankCosts,
    config: EmbeddingBagConfig,
    name: str,
    owners: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    lookups: torch.Tensor,
    placement: TablePlacement,
    workload: Workload,
    disk_tier: CachedTier | None,
    shared_with: DiskBlocks | None = None,
) -> None:
    """Memory, lookups, updates and disk IO of a table's blocks (block i: `rows[i]` x `cols[i]`
    on rank `owners[i]`, serving `lookups[i]` ids a step). `shared_with`: each rank's other
    disk blocks (`disk_blocks`), which share its cache with a disk block of this table."""
    row_state, col_state = state_widths(workload.rule(name)[0])
    row_bytes = cols * config.dtype.itemsize + (row_state + col_state * cols) * STATE_BYTES
    held = rows * row_bytes
    frozen = name in workload.frozen
    skew = workload.skew_of(name)
    touched = distinct(lookups, rows, config.num_embeddings, skew)
    updated = torch.zeros_like(touched) if frozen else touched
    # lookups read rows; an update reads and writes a row and its state and reads its gradient
    traffic = lookups * cols * config.dtype.itemsize + updated * (2 * row_bytes + cols * FLOAT32)
    costs.memory_traffic.index_add_(0, owners, traffic)
    costs.rows_touched.index_add_(0, owners, lookups + updated)
    costs.blocks.index_add_(0, owners, torch.ones_like(rows))
    if not placement.on_disk or disk_tier is None:  # (no tier given: counted as in memory)
        costs.memory.index_add_(0, owners, held)
        return
    blocks = [
        {
            **{k: b for k, b in (shared_with[o] if shared_with else {}).items() if k != name},
            name: (int(r), int(w)),
        }
        for o, r, w in zip(owners.tolist(), rows.tolist(), row_bytes.tolist(), strict=True)
    ]
    slots = torch.tensor([disk_tier.slots(b)[name] for b in blocks], dtype=torch.float64)
    # the rank's cache (its rows, those on their way to the file, its bookkeeping) once per
    # rank: each of its disk blocks counts the part of it that its bytes are of theirs (how
    # cache_bytes= is split), so the tables' parts add up to what the disk rule counts
    cached = torch.tensor(
        [
            disk_tier.cache_memory(b)
            * (b[name][0] * b[name][1])
            / (sum(r * w for r, w in b.values()) or 1)
            for b in blocks
        ],
        dtype=torch.float64,
    )
    costs.memory.index_add_(0, owners, cached)
    costs.disk.index_add_(0, owners, held)
    # the cache keeps the block's most popular rows (LRU and LFU both, near enough)
    share = rows / config.num_embeddings
    missed = torch.stack(
        [
            f * distinct_rows(n / f, config.num_embeddings, skew, int(k / f))
            for n, f, k in zip(lookups.tolist(), share.tolist(), slots.tolist(), strict=True)
        ]
    )
    written = torch.zeros_like(missed) if frozen else missed  # dirty rows evicted
    costs.disk_traffic.index_add_(0, owners, (missed + written) * row_bytes)
    costs.disk_rows.index_add_(0, owners, missed + written)


def replicated(
    costs: RankCosts,
    config: EmbeddingBagConfig,
    skew: float,
    world: int,
    per_node: int,
    ids: float,
    row_state: int,
    col_state: int,
    frozen: bool,
) -> None:
    """A data-parallel table: a full copy everywhere, its dense gradient all-reduced (a ring:
    each rank sends and receives 2 (W - 1) / W of the buffer, across nodes when there are
    several; step/data_parallel.py)."""
    rows, dim = config.num_embeddings, config.embedding_dim
    row_bytes = dim * config.dtype.itemsize + (row_state + col_state * dim) * STATE_BYTES
    costs.memory += rows * row_bytes
    updated = 0.0 if frozen else float(distinct_rows(torch.tensor(ids * world), rows, skew))
    costs.memory_traffic += ids * dim * config.dtype.itemsize + updated * (
        2 * row_bytes + dim * FLOAT32
    )
    costs.rows_touched += ids + updated
    costs.blocks += 1
    if frozen or world == 1:
        return
    ring = 2 * (world - 1) / world * rows * (dim + 1) * FLOAT32
    across = world > per_node
    (costs.sent_inter if across else costs.sent_intra).add_(ring)
    (costs.received_inter if across else costs.received_intra).add_(ring)
    costs.users["all_reduce"] = 1
