"""The bytes a sharded step's exchanges send between every pair of ranks: the traffic half of a
cost model, exact, computed from a plan without a job.

A step of a 1-D plan runs four all_to_alls (step/exchange.py; what they carry is
exchange_layout.py's, the routes routes.py's): the sizes (`3 + flag words` int64 to every other
rank), the ids (per routed feature: its bag lengths, then its ids, then its weights' bits, all
int64; a row-split table's ids only to the rows' owner), the pooled rows back (float32 or the
collection's wire dtype, step/wire.py; batch x the columns an owner
serves, and in float16 or float8 one overflow flag value per pair of ranks) and, in backward,
the output gradient to the owners (float32 or bfloat16; batch x the columns each owner needs,
full rows for a column-split table whose rule needs them; none for frozen tables; then one value,
the sender's non-finite flag, to every other rank where any gradient travels). A rank's
own part never travels. (Where the sizes ride in the ids all_to_all, step/ids_exchange.py, they
are the same bytes in one call fewer: rank_costs.CALLS.)

`exchange_bytes(configs, plan, batches)` counts them from each rank's batch, a batch per feature
too (exact: the tests compare them with the splits the exchanges really send);
`expected_exchange_bytes` from batch sizes and ids per bag, with ids spread evenly over a
table's rows (a plan's expectation), a batch per feature's bags too (`bags_per_feature`, as
PlanOptions'); `expected_sent_bytes` the same expectation's bytes each rank sends, without the
matrices (for thousands of ranks: four world x world matrices took 8 GB at 8,192).
Replicated (data-parallel) tables exchange no ids; their gradient all_reduce is not counted.
The sizes travel every step, every table replicated too; a float16 or float8 wire's overflow
flag only where some table is routed (all replicated: no pooled exchange runs).

Sequence tables (EmbeddingConfig, an EmbeddingCollection's) look each id up as a bag of its own,
every feature padded with empty bags to the batch's largest id count (sharded/
sequence_collection.py), in a compact layout: a length travels for every padded bag, but rows
and gradients only for the bags with an id in the owner's block, so one id's row per id.
A row-split bag table's blocks are compact too: a block returns, and takes gradients for, the
bags with an id in its rows (expected: batch x (1 - (1 - rows share)^(ids per bag))).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.exchange_layout import FLOAT32_WIRE, WireDtypes, flag_bytes, header_width
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.modules.sequence_collection import EmbeddingConfig
from manualpar.embeddings.plan import EmbeddingPlan
from manualpar.embeddings.routes import Routing
from manualpar.errors import PlanError

__all__ = [
    "EXCHANGES",
    "ExchangeBytes",
    "exchange_bytes",
    "expected_exchange_bytes",
    "expected_kept",
    "expected_sent_bytes",
    "is_sequence",
    "own_bags_of",
]

EXCHANGES = ("sizes", "ids", "pooled", "gradients")
INT64, FLOAT32 = 8, 4
Matrix = list[list[float]]


@dataclass(frozen=True)
class ExchangeBytes:
    """Per exchange, `bytes[name][sender][receiver]` of one step (0 on the diagonal)."""

    bytes: dict[str, Matrix]

    @property
    def world_size(self) -> int:
        return len(self.bytes["sizes"])

    def sent(self, rank: int) -> float:
        """Bytes `rank` sends in one step, over every exchange."""
        return sum(sum(matrix[rank]) for matrix in self.bytes.values())

    def received(self, rank: int) -> float:
        return sum(sum(row[rank] for row in matrix) for matrix in self.bytes.values())


def _zeros(world: int) -> Matrix:
    return [[0.0] * world for _ in range(world)]


def is_sequence(configs: Sequence[EmbeddingBagConfig]) -> bool:
    """Whether `configs` are a sequence collection's (EmbeddingConfig: one row per id)."""
    return bool(configs) and all(isinstance(c, EmbeddingConfig) for c in configs)


def expected_kept(bags: float, share: float, ids_per_bag: float) -> float:
    """Bags expected to hold an id in a row block with `share` of a table's rows, ids spread
    evenly over the rows (the rows a compact block returns; `ids_per_bag` need not be whole)."""
    if share >= 1.0:
        return bags
    return bags * (1.0 - (1.0 - share) ** ids_per_bag)


def _counts_by_group(
    routing: Routing, table: int, ids: torch.Tensor, lengths: torch.Tensor
) -> tuple[list[float], list[float]]:
    """How many of `ids` fall in each row group of `table` (one group unless split by rows),
    and how many bags (of `lengths`) hold one of them there."""
    starts = routing.row_start_tensors[table]
    group = torch.bucketize(ids, starts[1:], right=True)
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pairs = torch.unique(bag * len(starts) + group)
    kept = torch.bincount(pairs % len(starts), minlength=len(starts))
    return torch.bincount(group, minlength=len(starts)).tolist(), kept.tolist()


def _step_bytes(
    configs: Sequence[EmbeddingBagConfig],
    plan: EmbeddingPlan,
    batches: Sequence[float],
    ids_of: Mapping[tuple[int, int], list[float]],
    weighted: Sequence[bool],
    frozen: frozenset[str],
    full_rows: bool,
    kept_of: Mapping[tuple[int, int], list[float]],
    wire: WireDtypes = FLOAT32_WIRE,
    own_bags: Mapping[tuple[int, int], float] | None = None,
) -> ExchangeBytes:
    """`ids_of[(rank, feature)]`: the feature's ids per row group on that rank; `batches`: the
    bags per feature on each rank; `kept_of`, like `ids_of`: the bags whose rows and gradients
    travel (those with an id in the owner's block, in a compact layout or a row split);
    `own_bags`: a batch per feature's bags per (rank, feature), each route's count leading."""
    world = plan.world_size
    out = {name: _zeros(world) for name in EXCHANGES}
    width = header_width(len(configs))
    frozen_tables = {t for t, c in enumerate(configs) if c.name in frozen}
    routing = Routing(configs, plan, 0)  # who serves which route: the same from every sender
    grad_cols = {
        id(route): routing.dims[route.feature]
        if full_rows and routing.splits_cols(route.table)
        else route.cols
        for routes in routing.routes_to
        for route in routes
    }
    flag = flag_bytes(wire.forward) if any(routing.routes_to) else 0  # (none: no exchange)
    # the sender's non-finite flag after its gradient for each other rank (step/finite_check.py)
    routed = {route.table for routes in routing.routes_to for route in routes}
    grad_flag = wire.backward.itemsize if routed - frozen_tables else 0
    own_bags = own_bags or {}
    variable = {rank for rank, _ in own_bags}  # the senders of a batch per feature
    for sender in range(world):
        batch, copies = batches[sender], 2 if weighted[sender] else 1
        for owner in range(world):
            if owner == sender:
                continue
            out["sizes"][sender][owner] = width * INT64
            ids = pooled = grads = 0.0
            for route in routing.routes_to[owner]:
                here = ids_of[(sender, route.feature)][route.row_group]
                bags = kept_of[(sender, route.feature)][route.row_group]  # rows coming back
                lengths = batch  # (a batch per feature: its bags, after their count)
                if sender in variable:
                    lengths = own_bags[(sender, route.feature)] + 1
                ids += lengths + here * copies
                pooled += bags * route.cols
                if route.table not in frozen_tables:
                    grads += bags * grad_cols[id(route)]
            out["ids"][sender][owner] = ids * INT64
            # in the wire dtypes, with a range-limited dtype's overflow flag on every pair
            out["pooled"][owner][sender] = pooled * wire.forward.itemsize + flag
            out["gradients"][sender][owner] = grads * wire.backward.itemsize + grad_flag
    # a feature sent whole to several owners (column blocks) goes once to each: counted above
    return ExchangeBytes(out)


def exchange_bytes(
    configs: Sequence[EmbeddingBagConfig],
    plan: EmbeddingPlan,
    batches: Sequence[SparseFeatures],
    *,
    frozen: frozenset[str] = frozenset(),
    full_rows: bool = False,
    wire: WireDtypes = FLOAT32_WIRE,
) -> ExchangeBytes:
    """The exact bytes of one step in which rank r looks up `batches[r]` (features in the
    collection's order; a sequence collection's batch as its forward takes it). `full_rows`:
    the rule needs whole rows' gradients (row-wise Adagrad and clipping do, for column-split
    tables: FusedOptimizer.needs_full_rows). `wire`: the collection's wire_dtype."""
    if len(batches) != plan.world_size:
        raise PlanError(
            f"exchange_bytes: {len(batches)} batches for a plan of {plan.world_size} ranks; "
            "give each rank's batch"
        )
    routing = Routing(configs, plan, 0)
    ids_of: dict[tuple[int, int], list[float]] = {}
    kept_of: dict[tuple[int, int], list[float]] = {}
    own_bags: dict[tuple[int, int], float] = {}
    sequence = is_sequence(configs)
    for rank, features in enumerate(batches):
        variable = _own_bags(features)
        for f, (name, table) in enumerate(routing.features):
            feature = features[name]
            ids_of[(rank, f)], kept = _counts_by_group(
                routing, table, feature.values, feature.lengths
            )
            if sequence:  # one id a bag
                kept = ids_of[(rank, f)]
            # every bag of a whole table's; a batch per feature sends a row split's all too
            whole = not routing.splits_rows(table) or variable
            if whole and not sequence:
                kept = [float(feature.lengths.numel())] * len(kept)
            kept_of[(rank, f)] = kept
            if variable:
                own_bags[(rank, f)] = float(feature.lengths.numel())
    return _step_bytes(
        configs,
        plan,
        # a sequence batch becomes its largest feature's id count of one-id bags per feature
        [max(b.feature_sizes(), default=0) if sequence else b.batch_size for b in batches],
        ids_of,
        [b.weights is not None for b in batches],
        frozen,
        full_rows,
        kept_of,
        wire=wire,
        own_bags=own_bags,
    )


def _own_bags(features: SparseFeatures) -> bool:
    """Whether the step sends `features` as a batch per feature: a feature with bags of its
    own, not one per sample in order (step/bag_expansion.py's FeatureBags.variable)."""
    inverse = features.inverse_indices
    if inverse is None:
        return False
    batch = features.batch_size
    identity = torch.arange(batch, device=inverse.device)
    return any(n != batch for n in features.bag_counts()) or not bool((inverse == identity).all())


def _expected_bags(
    configs: Sequence[EmbeddingBagConfig], batch_per_rank: int, ids_per_bag: Mapping[str, float]
) -> float:
    """Bags a rank sends for each feature: its samples; for a sequence collection, its expected
    ids padded to the largest feature's count (the step pads every feature alike)."""
    if not is_sequence(configs):
        return float(batch_per_rank)
    names = [n for c in configs for n in c.feature_names]
    return max((batch_per_rank * ids_per_bag.get(n, 1.0) for n in names), default=0.0)


def _own_bag_counts(
    configs: Sequence[EmbeddingBagConfig],
    batch_per_rank: int,
    bags_per_feature: Mapping[str, float] | None,
) -> tuple[dict[str, float], bool]:
    """The bags a rank sends per feature of `configs` named in `bags_per_feature` (the others:
    one per sample), and whether the batch is a batch per feature (a count other than the
    batch: each route then sends its bag count first, and a row block every bag, as
    Workload.variable prices it); PlanError for a count a step cannot take."""
    own = dict(bags_per_feature or {})
    counts: dict[str, float] = {}
    for config in configs:
        named = own_bags_of(config, own)
        counts.update((f, float(n)) for f, n in named.items())
    return counts, any(n != batch_per_rank for n in counts.values())


def own_bags_of(
    config: EmbeddingBagConfig, bags_per_feature: Mapping[str, float]
) -> dict[str, float]:
    """The features of `config` named in `bags_per_feature`, with their counts; PlanError for a
    count a step cannot take (a sequence table's feature, a negative count)."""
    named = {f: bags_per_feature[f] for f in config.feature_names if f in bags_per_feature}
    if named and isinstance(config, EmbeddingConfig):
        raise PlanError(
            f"bags_per_feature: features {sorted(named)} of sequence table {config.name!r} "
            "cannot have their own bags (sequence embeddings take one sequence per sample); "
            "leave them out"
        )
    bad = {f: n for f, n in named.items() if not float(n) >= 0}
    if bad:
        raise PlanError(f"bags_per_feature: bag counts must be >= 0, got {bad}")
    return named


def expected_exchange_bytes(
    configs: Sequence[EmbeddingBagConfig],
    plan: EmbeddingPlan,
    batch_per_rank: int,
    ids_per_bag: Mapping[str, float],
    *,
    weighted: bool = False,
    frozen: frozenset[str] = frozenset(),
    full_rows: bool = False,
    wire: WireDtypes = FLOAT32_WIRE,
    bags_per_feature: Mapping[str, float] | None = None,
) -> ExchangeBytes:
    """The expected bytes of a step with `batch_per_rank` samples on every rank and, per
    feature, `ids_per_bag` ids a bag on average, spread evenly over the table's rows (a
    sequence collection: its bags padded to the largest feature's expected id count).
    `bags_per_feature` ({feature: bags a rank sends}, PlanOptions'): a batch per feature's
    features with bags of their own, the others one per sample."""
    routing = Routing(configs, plan, 0)
    ids_of: dict[tuple[int, int], list[float]] = {}
    kept_of: dict[tuple[int, int], list[float]] = {}
    own_bags: dict[tuple[int, int], float] = {}
    sequence = is_sequence(configs)
    bags = _expected_bags(configs, batch_per_rank, ids_per_bag)
    own, variable = _own_bag_counts(configs, batch_per_rank, bags_per_feature)
    for f, (name, table) in enumerate(routing.features):
        rows = configs[table].num_embeddings
        starts = [*routing.row_starts[table], rows]
        per_bag = ids_per_bag.get(name, 1.0)
        samples = own.get(name, batch_per_rank)  # the feature's bags (not a sequence's)
        shares = [(starts[g + 1] - starts[g]) / rows for g in range(len(starts) - 1)]
        share = [samples * per_bag * s for s in shares]
        kept = share if sequence else [expected_kept(bags, s, per_bag) for s in shares]
        if variable:  # every bag comes back, a row block's too
            kept = [samples] * len(shares)
        for rank in range(plan.world_size):
            ids_of[(rank, f)] = share
            kept_of[(rank, f)] = kept
            if variable:
                own_bags[(rank, f)] = samples
    world = plan.world_size
    return _step_bytes(
        configs,
        plan,
        [bags] * world,
        ids_of,
        [weighted] * world,
        frozen,
        full_rows,
        kept_of,
        wire,
        own_bags,
    )


def expected_sent_bytes(
    configs: Sequence[EmbeddingBagConfig],
    plan: EmbeddingPlan,
    batch_per_rank: int,
    ids_per_bag: Mapping[str, float],
    *,
    weighted: bool = False,
    frozen: frozenset[str] = frozenset(),
    full_rows: bool = False,
    wire: WireDtypes = FLOAT32_WIRE,
    bags_per_feature: Mapping[str, float] | None = None,
) -> list[float]:
    """Per rank, the bytes `expected_exchange_bytes(...).sent(rank)` sums, in memory linear in
    the ranks: with every rank's batch alike, what a sender exchanges with an owner depends on
    the owner alone, so each owner's exchange is summed once, table by table, in the routes'
    order (Routing: table, row block, column block, feature); the ranks' totals, added in
    another order, agree to the last bits. `bags_per_feature`: expected_exchange_bytes'."""
    world, copies = plan.world_size, 2 if weighted else 1
    sequence = is_sequence(configs)
    bags = _expected_bags(configs, batch_per_rank, ids_per_bag)
    own, variable = _own_bag_counts(configs, batch_per_rank, bags_per_feature)
    ids, pooled, grads = [0.0] * world, [0.0] * world, [0.0] * world  # per owner, from a sender
    for config in configs:
        if plan.tables[config.name].sharding == "data_parallel":
            continue
        shards = sorted(plan.shards(config), key=lambda s: (s.row_start, s.col_start))
        rows = config.num_embeddings
        starts = sorted({s.row_start for s in shards})
        group = {start: g for g, start in enumerate(starts)}
        ends = [*starts[1:], rows]
        whole_rows = full_rows and any(s.cols != config.embedding_dim for s in shards)
        frozen_table = config.name in frozen
        for shard in shards:
            owner, g = shard.rank, group[shard.row_start]
            grad_cols = config.embedding_dim if whole_rows else shard.cols
            share = (ends[g] - starts[g]) / rows
            for name in config.feature_names:
                per_bag = ids_per_bag.get(name, 1.0)
                samples = own.get(name, batch_per_rank)  # the feature's bags (a batch per
                here = samples * per_bag * share  # feature: its own, each route's count first)
                # the bags whose rows come back
                returned = here if sequence else expected_kept(bags, share, per_bag)
                if variable:
                    returned = samples
                ids[owner] += (samples + 1 if variable else bags) + here * copies
                pooled[owner] += returned * shard.cols
                if not frozen_table:
                    grads[owner] += returned * grad_cols
    sizes = (world - 1) * header_width(len(configs)) * INT64
    if any(plan.tables[c.name].sharding != "data_parallel" for c in configs):
        sizes += (world - 1) * flag_bytes(wire.forward)  # beside the pooled rows (step/wire.py)
    trained = [c for c in configs if c.name not in frozen]
    if any(plan.tables[c.name].sharding != "data_parallel" for c in trained):
        sizes += (world - 1) * wire.backward.itemsize  # the non-finite flag after the gradients
    row, grad = wire.forward.itemsize, wire.backward.itemsize
    all_ids = math.fsum(ids) * INT64  # (exactly rounded, then each owner's own taken off)
    all_grads = math.fsum(grads) * grad
    # a rank sends every other owner ids and gradients, and every other rank its pooled rows
    return [
        sizes + (all_ids - i * INT64) + p * row * (world - 1) + (all_grads - g * grad)
        for i, p, g in zip(ids, pooled, grads, strict=True)
    ]
