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

import dataclasses

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.exchange_layout import FLOAT32_WIRE, WireDtypes, flag_bytes, header_width
from manualpar.embeddings.ids.buckets import (
    layout_of,
    owner_blocks,
    remapper_bytes_at_owner,
    remapper_bytes_per_rank,
)
from manualpar.embeddings.plan import EmbeddingPlan, TablePlacement
from manualpar.embeddings.planning.block_costs import (
    FLOAT32,
    INT64,
    DiskBlocks,
    block_work,
    disk_blocks,
    distinct,
    owner_traffic,
    replicated,
    state_bytes,
    state_widths,
)
from manualpar.embeddings.planning.exchange_bytes import is_sequence
from manualpar.embeddings.planning.rank_costs import SIZES_WITH_IDS, RankCosts
from manualpar.embeddings.planning.topology import Topology
from manualpar.embeddings.planning.workload import Workload
from manualpar.embeddings.storage.cached_tier import CachedTier
from manualpar.errors import PlanError

__all__ = ["collection_costs", "placement_costs", "plan_costs", "shard_group"]


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
    disk_tier: CachedTier | None = None,
    name: str | None = None,
    replicas: int = 1,
    remaps_at_owner: bool = True,
    shared_with: DiskBlocks | None = None,
) -> RankCosts:
    """One table's costs per rank under `placement` (module docstring); `name`: the table's key
    in `workload` (default its config's name). With `replicas` > 1 (a 2-D mesh), `placement` is
    for one shard group and the costs are those of its ranks, the same in every group: the
    group's own exchanges plus the sum of the touched rows' gradients across the replicas
    (replica_combine.py). `remaps_at_owner`: a managed table placed whole on one rank holds
    all its remapper state there (False in a 2-D layout's shard group, whose remappers span
    the job). `shared_with`: each rank's other disk blocks, which share its cache with this
    table's (block_costs.disk_blocks; none: the cache is this table's alone)."""
    name = name or config.name
    if replicas > 1:
        return _two_d(config, placement, topology, workload, disk_tier, name, replicas)
    world, per_node = topology.world_size, topology.ranks_per_node
    costs = RankCosts.zeros(world)
    ids = workload.ids(config, name)  # per rank and step, all features of the table
    bags = workload.bags(config)  # (a batch per feature: each distinct bag travels once)
    state, full_rows = workload.rule(name)
    row_state, col_state = state_widths(state)
    frozen = name in workload.frozen
    if placement.sharding == "data_parallel":  # (no blocks to list: a copy on every rank)
        skew = workload.skew_of(name)
        replicated(costs, config, skew, world, per_node, ids, row_state, col_state, frozen)
        return costs
    shards = EmbeddingPlan(world, {config.name: placement}).shards(config)
    copies = 2 if workload.weighted else 1
    # bag lengths sent per feature, and the rows (and gradients) each block returns per
    # feature summed: a bag collection's every bag (a row block's: those with an id in its
    # rows, exchange_bytes.expected_kept); a sequence collection pads each feature
    # to its collection's largest id count (a bag per id; Workload.padded_ids, by default the
    # table's own) and returns one row per id found in the block (exchange_bytes.py)
    sequence = is_sequence([config])
    lengths: float = bags
    if sequence:
        padded = workload.padded_ids.get(name)
        batch, features = workload.batch_per_rank, len(config.feature_names)  # (one per sample)
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
    returned = ids * fraction if sequence else torch.full_like(fraction, bags)
    split = len({s.row_start for s in shards}) > 1
    if not sequence and split and not workload.variable:  # a row split's compact blocks
        per_bag = ids / bags if bags else 0.0
        returned = (1.0 - (1.0 - fraction) ** per_bag) * bags
    sent_to = (lengths + ids * fraction * copies) * INT64
    if workload.variable:  # each route's bag count leads (step/exchange.py)
        sent_to = sent_to + len(config.feature_names) * INT64
    costs.ids_in.index_add_(0, owners, sent_to)  # the ids payload (whether the sizes ride it)
    # rows and gradients in their wire dtypes (a float16/float8 flag: collection_costs')
    wire = workload.wire
    if not frozen:
        sent_to = sent_to + returned * grad_cols * wire.backward.itemsize
    to_owner = torch.zeros(world, dtype=torch.float64).index_add_(0, owners, sent_to)
    from_owner = torch.zeros(world, dtype=torch.float64).index_add_(
        0, owners, returned * cols * wire.forward.itemsize
    )
    owner_traffic(costs, to_owner, from_owner, per_node)
    if remaps_at_owner:  # a table remapped at its blocks' owners holds their remappers there
        _remappers_at_owners(costs, config, EmbeddingPlan(world, {config.name: placement}))
    block_work(
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
        shared_with,
    )
    costs.users["exchanges"] = 1
    return costs


def _remappers_at_owners(costs: RankCosts, config: EmbeddingBagConfig, plan: EmbeddingPlan) -> None:
    """The remapper state beyond each rank's share (collection_costs) on the owners of a table
    remapped at its owners: the path ids/buckets.owner_blocks chooses for the step."""
    blocks = owner_blocks(config, plan)
    if not blocks:
        return
    layout = layout_of(config)
    beyond = []
    for buckets in blocks.values():
        start, end = layout.row_range(buckets)
        beyond.append(float(remapper_bytes_at_owner(config, plan.world_size, end - start)))
    owners = torch.tensor(list(blocks))
    costs.memory.index_add_(0, owners, torch.tensor(beyond, dtype=torch.float64))


def _two_d(
    config: EmbeddingBagConfig,
    placement: TablePlacement,
    topology: Topology,
    workload: Workload,
    disk_tier: CachedTier | None,
    name: str,
    replicas: int,
) -> RankCosts:
    group = shard_group(topology, replicas)
    shard, per_node = group.world_size, topology.ranks_per_node
    if placement.sharding == "data_parallel":  # replicated over the whole job
        state, _ = workload.rule(name)
        costs = RankCosts.zeros(shard)
        row_state, col_state = state_widths(state)
        frozen = name in workload.frozen
        ids = workload.ids(config, name)
        skew = workload.skew_of(name)
        replicated(
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
    touched = distinct(lookups, rows, config.num_embeddings, skew)  # by this group's batches
    payload = (touched * (widths + 2) * FLOAT32 + INT64) * (replicas - 1)
    combine = torch.zeros(shard, dtype=torch.float64).index_add_(0, owners, payload)
    same_node = max(per_node // shard - 1, 0)  # replicas of my block on my node
    intra = combine * same_node / (replicas - 1)
    costs.sent_intra += intra
    costs.received_intra += intra
    costs.sent_inter += combine - intra
    costs.received_inter += combine - intra
    # every replica updates the union of the rows all replicas touched
    union = distinct(lookups * replicas, rows, config.num_embeddings, skew) - touched
    row_bytes = cols * config.dtype.itemsize + state_bytes(workload.rule(name)[0], cols)
    costs.memory_traffic.index_add_(0, owners, union * (2 * row_bytes + widths * FLOAT32))
    costs.rows_touched.index_add_(0, owners, union)
    costs.users["combine"] = 1
    return costs


def collection_costs(
    configs: list[EmbeddingBagConfig],
    plan: EmbeddingPlan,
    topology: Topology,
    replicas: int = 1,
    wire: WireDtypes = FLOAT32_WIRE,
) -> RankCosts:
    """Costs shared by a collection's tables: every rank's share of the managed-collision
    remappers (split over the whole job, ids/buckets.py; an owner's state beyond it is its
    placement's), the sizes all_to_all (3 + flag words int64 to every other rank of the job,
    those of the other shard groups too: StepParts.exchange_headers) and a range-limited
    `wire`'s overflow flag (one value to every other rank of the shard group beside the pooled
    rows, step/wire.py): a step sends the sizes every time, its tables all replicated too,
    the flag only where some table is routed to an owner (tables all replicated: no pooled
    exchange runs, StepParts.exchange; tests/dist/test_emb_planning_variable_batch_ranks.py
    counts them). The sizes all_to_all's latency is counted once (RankCosts.collectives), and
    not at all where a 1-D step's sizes ride in its ids all_to_all (SIZES_WITH_IDS, set here)."""
    share = remapper_bytes_per_rank(configs, topology.world_size)
    group = shard_group(topology, replicas) if replicas > 1 else topology
    costs = RankCosts.zeros(group.world_size)
    costs.memory += share
    words = header_width(len(configs)) * INT64
    to_owner = torch.full((group.world_size,), float(words), dtype=torch.float64)
    routed = any(plan.tables[c.name].sharding != "data_parallel" for c in configs)
    # and the non-finite flag after the gradients (one value to every other rank, step/
    # finite_check.py)
    flag = flag_bytes(wire.forward) + wire.backward.itemsize
    flags = torch.full_like(to_owner, float(flag if routed else 0))
    owner_traffic(costs, to_owner, flags, group.ranks_per_node)
    # the sizes to (and from) the other groups' ranks: on my node those beside my group
    beside = max(topology.ranks_per_node - group.world_size, 0)
    elsewhere = topology.world_size - group.world_size - beside
    for sent, received, peers in (
        (costs.sent_intra, costs.received_intra, beside),
        (costs.sent_inter, costs.received_inter, elsewhere),
    ):
        sent += words * peers
        received += words * peers
    if topology.world_size > 1:  # its latency: alone where every table is replicated (CALLS)
        costs.users["sizes"] = 1
        if replicas == 1:  # inside the ids all_to_all while the payloads are short (CALLS)
            costs.users[SIZES_WITH_IDS] = 1
    return costs


def plan_costs(
    configs: list[EmbeddingBagConfig],
    plan: EmbeddingPlan,
    topology: Topology,
    workload: Workload,
    disk_tier: CachedTier | None = None,
    replicas: int = 1,
) -> RankCosts:
    """A whole plan's costs per rank: its tables' plus the collection's (with `replicas`, per
    rank of a shard group, the plan being for that group). A plan that records its wire
    dtypes (EmbeddingPlan.wire, the planner's pick) is priced with them, as it will run."""
    if plan.wire is not None:
        workload = dataclasses.replace(workload, wire=plan.wire)
    total = collection_costs(configs, plan, topology, replicas, workload.wire)
    placed = {config.name: (config, plan.tables[config.name]) for config in configs}
    one_d = disk_tier is not None and replicas == 1  # (a 2-D mesh has no disk tier)
    shared = disk_blocks(placed, topology.world_size, workload) if one_d else None
    for config, placement in placed.values():
        total = total + placement_costs(
            config,
            placement,
            topology,
            workload,
            disk_tier,
            replicas=replicas,
            shared_with=shared,
        )
    return total
