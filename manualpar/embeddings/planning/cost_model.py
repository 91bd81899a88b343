"""What one table's placement costs each rank in a step: memory, bytes per link, rows, seconds.

    costs = placement_costs(config, row_wise(), topology, workload)
    costs.seconds(topology)        # predicted time per rank (a tensor of world_size)

The bytes are those of the step's exchanges (exchange_bytes.py explains them) for a batch whose
ids are spread evenly over the table's rows, summed per rank, split by direction and by whether
the peer is on the same node; a test checks them against exchange_bytes and against the splits
a real step sends. They are computed per rank in closed form (no rank x rank matrix), so a plan
for thousands of ranks and hundreds of tables costs seconds.

Seconds per rank = exchanges + memory traffic + disk, one after another (a step runs its phases
in order; the train pipeline overlaps the input only):
- exchanges: max(bytes over intra-node links / their bandwidth, bytes over inter-node links /
  theirs), each direction's larger side, plus one latency per all_to_all;
- memory: the rows the rank looks up and updates (weights, gradients and optimizer state, read
  and written) at the memory bandwidth, plus a fixed cost per row touched and per block held
  (a table split over 8 ranks launches its kernels on each of them);
- disk: for a disk-tier table, the rows its cache misses (the distinct rows a step touches
  beyond the most popular ones the cache holds) read, and as many dirty rows written back.
Distinct rows follow the ids' popularity: uniform, or Zipf with the exponent `Workload.skew`
(the popular rows spread over the blocks, as hashed or remapped ids are).
Known errors: collectives are taken as fully using their links; the cache is taken to hold the
most popular rows (LRU and LFU come close under Zipf); compute of the dense model and the
overlap of phases on GPUs are not modelled.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from manualpar.embeddings.config import STATE_BYTES, EmbeddingBagConfig
from manualpar.embeddings.ids.buckets import (
    REMAPPED_AT_OWNER,
    remapper_bytes_at_owner,
    remapper_bytes_per_rank,
)
from manualpar.embeddings.plan import EmbeddingPlan, TablePlacement
from manualpar.embeddings.planning.exchange_bytes import is_sequence
from manualpar.embeddings.planning.popularity import distinct_rows
from manualpar.embeddings.planning.rank_costs import RankCosts, Workload
from manualpar.embeddings.planning.topology import Topology
from manualpar.embeddings.step.frozen import num_words
from manualpar.embeddings.storage.disk_tier import DiskTier
from manualpar.errors import PlanError

__all__ = ["collection_costs", "placement_costs", "plan_costs", "shard_group"]

INT64, FLOAT32 = 8, 4


def _owner_traffic(
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


def _distinct(
    lookups: torch.Tensor, rows: torch.Tensor, table_rows: int, skew: float
) -> torch.Tensor:
    """Expected distinct rows a step touches in each block (`rows[i]` of a `table_rows` table,
    serving `lookups[i]` ids): the popular rows are spread over the blocks (ids are scattered by
    the remap or the data), so a block sees its share of the table's distinct rows."""
    share = rows / table_rows
    return share * distinct_rows(lookups / share.clamp(min=1e-30), table_rows, skew)


def shard_group(topology: Topology, replicas: int) -> Topology:
    """The topology of one shard group of a 2-D mesh (`replicas` x world / replicas, groups of
    consecutive ranks, as strategy.mesh(replicate=R, shard=S) lays them out)."""
    world, per_node = topology.world_size, topology.ranks_per_node
    if replicas < 1 or world % replicas:
        raise PlanError(f"replicas={replicas} must divide the world size {world}")
    shard = world // replicas
    if shard % per_node and per_node % shard:
        raise PlanError(
            f"a shard group of {shard} ranks must fill whole nodes of {per_node} ranks or divide "
            f"one; choose replicas so that world / replicas does (world {world})"
        )
    return topology.with_world(shard, min(per_node, shard))


def placement_costs(
    config: EmbeddingBagConfig,
    placement: TablePlacement,
    topology: Topology,
    workload: Workload,
    disk_tier: DiskTier | None = None,
    name: str | None = None,
    replicas: int = 1,
    remaps_at_owner: bool = True,
) -> RankCosts:
    """One table's costs per rank under `placement` (module docstring); `name`: the table's key
    in `workload` (default its config's name). With `replicas` > 1 (a 2-D mesh), `placement` is
    for one shard group and the costs are those of its ranks, the same in every group: the
    group's own exchanges plus the sum of the touched rows' gradients across the replicas
    (replica_combine.py). `remaps_at_owner`: a managed table placed whole on one rank holds
    all its remapper state there (False in a 2-D layout's shard group, whose remappers span
    the job)."""
    name = name or config.name
    if replicas > 1:
        return _two_d(config, placement, topology, workload, disk_tier, name, replicas)
    world, per_node = topology.world_size, topology.ranks_per_node
    costs = RankCosts.zeros(world)
    ids = workload.ids(config, name)  # per rank and step, all features of the table
    features = len(config.feature_names)
    batch = workload.batch_per_rank
    state, full_rows = workload.rule(name)
    row_state, col_state = _state_widths(state)
    frozen = name in workload.frozen
    if placement.sharding == "data_parallel":  # (no blocks to list: a copy on every rank)
        skew = workload.skew_of(name)
        _replicated(costs, config, skew, world, per_node, ids, row_state, col_state, frozen)
        return costs
    shards = EmbeddingPlan(world, {config.name: placement}).shards(config)
    copies = 2 if workload.weighted else 1
    # bag lengths sent per feature, and the rows (and gradients) each block returns per
    # feature summed: a bag collection's every bag; a sequence collection pads each feature
    # to its collection's largest id count (a bag per id; Workload.padded_ids, by default the
    # table's own) and returns one row per id found in the block (exchange_bytes.py)
    sequence = is_sequence([config])
    lengths: float = batch * features
    if sequence:
        padded = workload.padded_ids.get(name)
        lengths = ids if padded is None else batch * padded * features
    owners = torch.tensor([s.rank for s in shards])
    rows = torch.tensor([s.rows for s in shards], dtype=torch.float64)
    cols = torch.tensor([s.cols for s in shards], dtype=torch.float64)
    fraction = rows / config.num_embeddings
    grad_cols = (
        torch.full_like(cols, config.embedding_dim)
        if full_rows and placement.sharding == "column_wise"
        else cols
    )
    returned = ids * fraction if sequence else torch.full_like(fraction, batch * features)
    sent_to = (lengths + ids * fraction * copies) * INT64
    # rows and gradients in their wire dtypes (a float16/float8 flag, 1 value a pair, left out)
    if not frozen:
        sent_to = sent_to + returned * grad_cols * workload.wire.backward.itemsize
    to_owner = torch.zeros(world, dtype=torch.float64).index_add_(0, owners, sent_to)
    from_owner = torch.zeros(world, dtype=torch.float64).index_add_(
        0, owners, returned * cols * workload.wire.forward.itemsize
    )
    _owner_traffic(costs, to_owner, from_owner, per_node)
    if placement.sharding in REMAPPED_AT_OWNER and remaps_at_owner:  # its blocks' remappers
        beyond = [float(remapper_bytes_at_owner(config, world, s.rows)) for s in shards]
        costs.memory.index_add_(0, owners, torch.tensor(beyond, dtype=torch.float64))
    _block_work(
        costs,
        config,
        name,
        owners,
        rows,
        cols,
        ids * fraction * world,
        placement,
        workload,
        disk_tier,
    )
    costs.users["exchanges"] = 1
    return costs


def _two_d(
    config: EmbeddingBagConfig,
    placement: TablePlacement,
    topology: Topology,
    workload: Workload,
    disk_tier: DiskTier | None,
    name: str,
    replicas: int,
) -> RankCosts:
    group = shard_group(topology, replicas)
    shard, per_node = group.world_size, topology.ranks_per_node
    if placement.sharding == "data_parallel":  # replicated over the whole job
        state, _ = workload.rule(name)
        costs = RankCosts.zeros(shard)
        row_state, col_state = _state_widths(state)
        frozen = name in workload.frozen
        ids = workload.ids(config, name)
        skew = workload.skew_of(name)
        _replicated(
            costs, config, skew, topology.world_size, per_node, ids, row_state, col_state, frozen
        )
        return costs
    # (a 2-D layout's remappers span the job: none is remapped at a table's owner)
    costs = placement_costs(
        config, placement, group, workload, disk_tier, name, remaps_at_owner=False
    )
    if name in workload.frozen:
        return costs
    _, full_rows = workload.rule(name)
    shards = EmbeddingPlan(shard, {config.name: placement}).shards(config)
    owners = torch.tensor([s.rank for s in shards])
    rows = torch.tensor([s.rows for s in shards], dtype=torch.float64)
    cols = torch.tensor([s.cols for s in shards], dtype=torch.float64)
    widths = (
        torch.full_like(cols, config.embedding_dim)
        if full_rows and placement.sharding == "column_wise"
        else cols
    )
    lookups = workload.ids(config, name) * rows / config.num_embeddings * shard
    skew = workload.skew_of(name)
    touched = _distinct(lookups, rows, config.num_embeddings, skew)  # by this group's batches
    payload = (touched * (widths + 2) * FLOAT32 + INT64) * (replicas - 1)
    combine = torch.zeros(shard, dtype=torch.float64).index_add_(0, owners, payload)
    same_node = max(per_node // shard - 1, 0)  # replicas of my block on my node
    intra = combine * same_node / (replicas - 1)
    costs.sent_intra += intra
    costs.received_intra += intra
    costs.sent_inter += combine - intra
    costs.received_inter += combine - intra
    # every replica updates the union of the rows all replicas touched
    union = _distinct(lookups * replicas, rows, config.num_embeddings, skew) - touched
    row_bytes = cols * config.dtype.itemsize + _state_bytes(workload.rule(name)[0], cols)
    costs.memory_traffic.index_add_(0, owners, union * (2 * row_bytes + widths * FLOAT32))
    costs.rows_touched.index_add_(0, owners, union)
    costs.users["combine"] = 1
    return costs


def _state_bytes(state: Mapping[str, bool], cols: torch.Tensor) -> torch.Tensor:
    row_state, col_state = _state_widths(state)
    return (row_state + col_state * cols) * STATE_BYTES


def _state_widths(state: Mapping[str, bool]) -> tuple[int, int]:
    """(state floats per row, state floats per element) of an update rule's STATE."""
    per_row = sum(1 for whole_row in state.values() if whole_row)
    return per_row, len(state) - per_row


def _block_work(
    costs: RankCosts,
    config: EmbeddingBagConfig,
    name: str,
    owners: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    lookups: torch.Tensor,
    placement: TablePlacement,
    workload: Workload,
    disk_tier: DiskTier | None,
) -> None:
    """Memory, lookups, updates and disk IO of a table's blocks (block i: `rows[i]` x `cols[i]`
    on rank `owners[i]`, serving `lookups[i]` ids a step)."""
    row_state, col_state = _state_widths(workload.rule(name)[0])
    row_bytes = cols * config.dtype.itemsize + (row_state + col_state * cols) * STATE_BYTES
    held = rows * row_bytes
    frozen = name in workload.frozen
    skew = workload.skew_of(name)
    distinct = _distinct(lookups, rows, config.num_embeddings, skew)
    updated = torch.zeros_like(distinct) if frozen else distinct
    # lookups read rows; an update reads and writes a row and its state and reads its gradient
    traffic = lookups * cols * config.dtype.itemsize + updated * (2 * row_bytes + cols * FLOAT32)
    costs.memory_traffic.index_add_(0, owners, traffic)
    costs.rows_touched.index_add_(0, owners, lookups + updated)
    costs.blocks.index_add_(0, owners, torch.ones_like(rows))
    if not placement.on_disk or disk_tier is None:  # (no tier given: counted as in memory)
        costs.memory.index_add_(0, owners, held)
        return
    slots = torch.tensor(
        [
            disk_tier.slots({name: (int(r), int(w))})[name]
            for r, w in zip(rows.tolist(), row_bytes.tolist(), strict=True)
        ],
        dtype=torch.float64,
    )
    costs.memory.index_add_(0, owners, slots * row_bytes)
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


def _replicated(
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


def collection_costs(
    configs: list[EmbeddingBagConfig], plan: EmbeddingPlan, topology: Topology, replicas: int = 1
) -> RankCosts:
    """Costs shared by a collection's tables: every rank's share of the managed-collision
    remappers (split over the whole job, ids/buckets.py; an owner's state beyond it is its
    placement's), and the sizes all_to_all (3 + flag words int64 to every other rank of the
    shard group), when any table is sharded."""
    share = remapper_bytes_per_rank(configs, topology.world_size)
    topology = shard_group(topology, replicas) if replicas > 1 else topology
    costs = RankCosts.zeros(topology.world_size)
    costs.memory += share
    if all(plan.tables[c.name].sharding == "data_parallel" for c in configs):
        return costs
    words = (3 + num_words(len(configs))) * INT64
    to_owner = torch.full((topology.world_size,), float(words), dtype=torch.float64)
    _owner_traffic(costs, to_owner, torch.zeros_like(to_owner), topology.ranks_per_node)
    return costs


def plan_costs(
    configs: list[EmbeddingBagConfig],
    plan: EmbeddingPlan,
    topology: Topology,
    workload: Workload,
    disk_tier: DiskTier | None = None,
    replicas: int = 1,
) -> RankCosts:
    """A whole plan's costs per rank: its tables' plus the collection's (with `replicas`, per
    rank of a shard group, the plan being for that group)."""
    total = collection_costs(configs, plan, topology, replicas)
    for config in configs:
        placement = plan.tables[config.name]
        total = total + placement_costs(
            config, placement, topology, workload, disk_tier, replicas=replicas
        )
    return total
