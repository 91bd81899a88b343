"""Layout of one step's exchanges: which ids, pooled rows and gradients go to which rank.

Per step (each `all_to_all_single`; the list form fails on gloo for unequal sizes):
  1. sizes: every rank sends every rank [batch size, payload length, weighted, frozen table
     flags...] (size_header.py; frozen.py: the ranks must agree on them);
  2. payload: bag lengths, ids (row-local) and per-id weights (as int64 bit patterns) in one
     buffer per destination, so one collective carries all three; 1 and 2 are one all_to_all
     where the payloads are short (ids_exchange.py: each pair's room for its payload agreed
     from the pair's history, the rest point-to-point);
  3. pooled output: each owner sends back per-bag partial sums (row-wise shards are summed, and
     column blocks concatenated, by the receiver: no separate reduce-scatter);
  4. in backward, the reverse of 3 carries the output gradient (of the tables not frozen).
A rank's own part of 2-4 never enters the collectives (its split is 0): it is computed and
used in place while the other ranks' parts travel (forward.py, backward.py). With every table
replicated (no route), 2-4 do not run at all (StepParts.exchange): 1 alone, which carries the
refusals, frozen flags and batch sizes. Row-wise tables split each feature's ids by row range (a
stable sort keeps bag order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.ids.remap import RawIdRoutes
from manualpar.embeddings.kernels.native import native_kernels_take
from manualpar.embeddings.step.bag_expansion import FeatureBags, route_sums
from manualpar.embeddings.step.column_blocks import column_view, strided_spans
from manualpar.embeddings.step.gradient_layout import GradientLayout, Kept
from manualpar.embeddings.step.routing import Route, Routing
from manualpar.embeddings.step.sender_bags import (
    Packed,
    SenderBags,
    combine_senders,
    every_split,
    feature_runs,
    join_payloads,
    pack_pooled,
    pack_runs,
    pack_split_rows,
    split_by_rows,
    weight_bits,
)

__all__ = [
    "ExchangeLayout",
    "Kept",
    "SenderBags",
    "combine_senders",
    "pack_pooled",
    "split_by_rows",
]


def _bits_weight(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


class ExchangeLayout(GradientLayout):
    """One plan's exchange layout, bound to its Routing: what this rank packs for each other
    rank, and how it reads what they send (ids, pooled rows, output gradients)."""

    def __init__(
        self, routing: Routing, compact: bool = False, raw_routes: RawIdRoutes | None = None
    ) -> None:
        super().__init__(routing)
        # raw ids remapped at their owners: a row-split table's go to their bucket's block
        self.raw_routes = raw_routes
        # compact: bags with no ids on an owner are left out of its pooled rows and gradients
        # (see `kept_bags`); a sequence collection's bags hold one id each, so a row-split
        # table's owner serves a bag out of every world-size, and every feature is padded
        self.compact = compact
        # a row-split table's are left out in any layout: with one id a bag, a block of 64
        # returns a 64th of the rows a whole table does (a node group's row split, planning/)
        tables = range(len(routing.tables))
        self.compact_tables = frozenset(t for t in tables if compact or routing.splits_rows(t))
        # pack_ids' per-feature routing, fixed by the plan: (feature, table, the destinations
        # of a table not split by rows, else None)
        self._feature_dests = [
            (f, routes[0][1].table, None if routing.splits_rows(routes[0][1].table) else dests)
            for f, routes in enumerate(routing.routes_of_feature)
            if routes
            for dests in [[dest for dest, _ in routes]]
        ]
        # per destination, its runs of consecutive whole features (None with a row split)
        self._runs = feature_runs([(f, d) for f, _, d in self._feature_dests], routing.world_size)
        # row-wise plans: one kernel pass packs the ids (None: per feature)
        self._every_split = (
            None if raw_routes is not None else every_split(routing, self._feature_dests)
        )
        # unpack_ids': per routed local shard, (its first route, its routes, its table)
        self._shard_routes: list[tuple[int, int, int]] = []
        for shard in routing.routed_local_shards():
            row = sum(count for _, count, _ in self._shard_routes)
            self._shard_routes.append((row, len(shard.features), shard.table))
        # per owner: its routes' output columns as one strided block (column_blocks.py), or None
        self._pooled_strided = [
            strided_spans([(self._out_start(r), self._out_start(r) + r.cols) for r in routes])
            for routes in routing.routes_to
        ]
        self._splits: dict[tuple[int, ...], list[int]] = {}  # output_splits' of a whole batch
        # each output column written by exactly one route or replicated table (table-wise,
        # column-wise; not a row split, whose owners' partial sums add up): see `fills_output`
        self.writes_once = self._writes_once()

    def _writes_once(self) -> bool:
        routing = self.routing
        if any(routing.splits_rows(t) for t in range(len(routing.tables))):
            return False
        cover = torch.zeros(routing.total_dim, dtype=torch.int32)
        for routes in routing.routes_to:
            for route in routes:
                start = self._out_start(route)
                cover[start : start + route.cols] += 1
        for f, (_, t) in enumerate(routing.features):
            if t in routing.data_parallel:
                start = routing.feature_offsets[f]
                cover[start : start + routing.dims[f]] += 1
        return bool((cover == 1).all())

    def fills_output(self, kept: Kept, wire: torch.dtype) -> bool:
        """Whether a step's output can start unfilled (torch.empty) and every pooled block be
        copied into it (`add_pooled`/`add_block` with copy=True) for the same bits as adding it
        into zeros: every column written once, every bag's rows (no compact layout), and the
        received rows exactly the owners' sums (a float32 wire). 0 + x has x's bits except for
        x = -0.0, which no pooled sum is: each sums into +0 (embedding_bag, the native kernels),
        but a narrower wire can round a tiny negative sum to -0.0."""
        return self.writes_once and kept is None and wire == torch.float32

    def _out_start(self, route: Route) -> int:
        return self.routing.feature_offsets[route.feature] + route.shard.col_start

    def send_every_bag(self) -> None:
        """The exchange before compact layouts (every bag to every owner, row splits too): the
        baseline the benchmarks and the compact-exchange tests measure against."""
        self.compact, self.compact_tables = False, frozenset()

    def compacts(self, variable: bool) -> bool:
        """Whether a sender's bags travel compact (a batch per feature: only in a compact
        layout, whose rows it expands after the exchange; a row split sends all its bags)."""
        return bool(self.compact_tables) and (self.compact or not variable)

    def pack_ids(
        self,
        features: SparseFeatures,
        lengths: Sequence[torch.Tensor] | torch.Tensor,
        bags: FeatureBags,
    ) -> Packed:
        """Per destination rank: the lengths, ids and weight bits of the bags it serves us, in its
        route order, every payload in one buffer (the other ranks' joined for the exchange).
        `lengths`: each feature's bag lengths (bag_lengths'); a variable batch sends each
        route's bag count first."""
        world, rank = self.routing.world_size, self.routing.rank
        values, weights = features.values, features.weights
        heads = self._heads(bags, values.device)
        if self._runs is not None:  # whole features only: slices of the batch, not one each
            return pack_runs(self._runs, features, bags.counts, heads, rank)
        split = self._every_split
        if (
            split is not None
            and weights is None
            and not bags.variable
            and native_kernels_take(values)
        ):  # every feature split by rows alike: one pass, no tensor per feature
            return pack_split_rows(split, features, rank, world)
        lengths = list(lengths)  # cut here: the slices of the batch above need no cut
        per_feature = features.feature_sizes()
        id_of = values.split(per_feature)  # each feature's ids: one call, not a slice each
        weight_of = None if weights is None else weights.split(per_feature)
        lens_to: list[list[torch.Tensor]] = [[] for _ in range(world)]
        ids_to: list[list[torch.Tensor]] = [[] for _ in range(world)]
        weights_to: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for f, table, dests in self._feature_dests:
            ids = id_of[f]
            w = None if weight_of is None else weight_of[f]
            if dests is not None:  # the whole feature to each owner of a block of its columns
                for dest in dests:
                    lens_to[dest].append(lengths[f])
                    ids_to[dest].append(ids)
                    if w is not None:
                        weights_to[dest].append(w)
                continue
            routes = self.routing.routes_of_feature[f]
            remap = self.raw_routes
            raw = remap is not None and table in remap.tables
            keys = remap.route_keys(table, ids) if remap is not None and raw else ids
            counts, local_ids, order = split_by_rows(keys, lengths[f], self.routing, table)
            if raw:  # the raw ids travel, in their blocks' order; their owners remap them
                local_ids = ids[order]
            sizes = counts.sum(1).tolist()
            id_parts = local_ids.split(sizes)
            w_parts = None if w is None else w[order].split(sizes)
            for dest, route in routes:
                g = route.row_group
                lens_to[dest].append(counts[g])
                ids_to[dest].append(id_parts[g])
                if w_parts is not None:
                    weights_to[dest].append(w_parts[g])
        pieces_to = [
            [*heads[d], *lens_to[d], *ids_to[d], *(weight_bits(w) for w in weights_to[d])]
            if lens_to[d]
            else []
            for d in range(world)
        ]
        return join_payloads(pieces_to, rank, values.device)

    def _heads(self, bags: FeatureBags, device: torch.device) -> list[list[torch.Tensor]]:
        """Per destination: what leads its payload (a variable batch: each route's bag count)."""
        heads: list[list[torch.Tensor]] = [[] for _ in range(self.routing.world_size)]
        if bags.variable:
            for d, served in enumerate(self.routing.routes_to):
                per_route = [bags.counts[route.feature] for route in served]
                heads[d] = [torch.tensor(per_route, dtype=torch.int64, device=device)]
        return heads

    def kept_bags(self, payloads: list[torch.Tensor], batch: int, variable: bool = False) -> Kept:
        """Sender side, compact tables: per owner (None for ourselves), per route to it, the
        bags of our batch with ids there (None: all of them, as for a table not compact: the
        whole (batch, cols) block travels, with no index to apply). None where no bag is left
        out anywhere (a row split's bags of many ids): the plain layout's, whose blocks travel
        and add up as one strided block per owner, not one per route."""
        if not self.compacts(variable):
            return None
        kept: list[list[torch.Tensor | None] | None] = []
        left_out = False
        for owner, routes in enumerate(self.routing.routes_to):
            if owner == self.routing.rank:
                kept.append(None)
                continue
            lens = payloads[owner][: len(routes) * batch].view(len(routes), batch)
            if bool(lens.all()):  # every bag has ids there: one test, not one per route
                kept.append([None] * len(routes))
                continue
            rows = [
                torch.nonzero(row).flatten() if route.table in self.compact_tables else None
                for route, row in zip(routes, lens, strict=True)
            ]
            kept.append([None if r is None or r.numel() == batch else r for r in rows])
            left_out = left_out or any(r is not None for r in kept[-1] or ())
        return kept if left_out else None

    def unpack_ids(
        self,
        payload: torch.Tensor,
        batch: int,
        weighted: bool,
        compact: bool = False,
        variable: bool = False,
    ) -> list[SenderBags]:
        """One sender's payload to us -> its bags for each of our routed local shards
        (`compact`: the bags with ids only; `variable`: a batch per feature, each route's bag
        count first)."""
        routes = len(self.routing.routes_to[self.routing.rank])
        head = routes if variable else 0
        counts = payload[:head].tolist() if variable else [batch] * routes
        lens = payload[head : head + sum(counts)]
        route_ids = route_sums(lens, counts)
        total = sum(route_ids)
        ids = payload[head + lens.numel() : head + lens.numel() + total]
        bits = payload[head + lens.numel() + total :] if weighted else None
        shards = self._shard_routes
        n_ids = [sum(route_ids[row : row + count]) for row, count, _ in shards]
        n_bags = [sum(counts[row : row + count]) for row, count, _ in shards]
        id_parts = ids[: sum(n_ids)].split(n_ids)  # one call each, not a slice per shard
        len_parts = lens[: sum(n_bags)].split(n_bags)
        bit_parts = None if bits is None else bits[: sum(n_ids)].split(n_ids)
        bags: list[SenderBags] = []
        compact = compact and not bool(lens.all())  # no empty bag: nothing left out
        for k, (_, _, table) in enumerate(shards):
            shard_lens = len_parts[k]
            if compact and table in self.compact_tables:
                shard_lens = shard_lens[shard_lens > 0]
            weights = None if bit_parts is None else _bits_weight(bit_parts[k])
            bags.append((id_parts[k], shard_lens, weights))
        return bags

    def pooled_blocks(
        self,
        owner: int,
        received: torch.Tensor,
        counts: Sequence[int],
        kept: list[torch.Tensor | None] | None = None,
    ) -> list[tuple[Route, torch.Tensor, torch.Tensor | None]]:
        """Receiver side: an owner's pooled buffer for our batch (`counts`: each feature's
        bags) -> (route, (bags, cols) block, the batch rows of its bags: None for all of them)
        per route (`kept`: kept_bags')."""
        blocks = []
        offset = 0
        for r, route in enumerate(self.routing.routes_to[owner]):
            rows = None if kept is None else kept[r]
            bags = counts[route.feature] if rows is None else rows.numel()
            size = bags * route.cols
            blocks.append((route, received[offset : offset + size].view(bags, route.cols), rows))
            offset += size
        return blocks

    def output_splits(self, counts: Sequence[int], kept: Kept = None) -> list[int]:
        """Receiver side: how many floats each other owner sends back for our batch
        (`counts`: each feature's bags)."""
        if kept is None:  # the same for every batch of these counts: made once
            found = self._splits.get(tuple(counts))
            if found is None:
                if len(self._splits) >= 16:
                    self._splits.clear()
                found = self._splits[tuple(counts)] = self._output_splits(counts, None)
            return found
        return self._output_splits(counts, kept)

    def _output_splits(self, counts: Sequence[int], kept: Kept) -> list[int]:
        splits = []
        for owner, routes in enumerate(self.routing.routes_to):
            owner_kept = None if kept is None else kept[owner]
            if owner == self.routing.rank:
                splits.append(0)
            elif owner_kept is None:
                splits.append(sum(counts[r.feature] * r.cols for r in routes))
            else:
                splits.append(
                    sum(
                        (counts[r.feature] if k is None else k.numel()) * r.cols
                        for k, r in zip(owner_kept, routes, strict=True)
                    )
                )
        return splits

    def zero_own(self, out: torch.Tensor) -> None:
        """Zero this rank's own routes' columns of an unfilled output (for a lookup that adds
        into them)."""
        strided = self._pooled_strided[self.routing.rank]
        if strided is not None:
            column_view(out, strided).zero_()
            return
        for route in self.routing.routes_to[self.routing.rank]:
            start = self._out_start(route)
            out[:, start : start + route.cols].zero_()

    def add_pooled(
        self,
        out: torch.Tensor,
        owner: int,
        received: torch.Tensor,
        bags: FeatureBags,
        kept: list[torch.Tensor | None] | None = None,
        copy: bool = False,
    ) -> None:
        """Receiver side: add an owner's pooled buffer for our batch into the output, each bag's
        rows expanded to the batch (`kept`: kept_bags' for this owner); equally spaced routes
        of a plain batch in one strided add (column_blocks.py). `copy`: copied instead, into
        an output left unfilled (`fills_output`)."""
        strided = self._pooled_strided[owner]
        if strided is not None and kept is None and not bags.variable:
            blocks, _, _, width = strided
            if received.numel() == blocks * out.shape[0] * width:
                view, rows = column_view(out, strided), received.view(blocks, out.shape[0], width)
                if copy:
                    view.copy_(rows)
                else:
                    view.add_(rows)
                return
        for route, block, kept_rows in self.pooled_blocks(owner, received, bags.counts, kept):
            self.add_block(out, route, bags.expand(route.feature, block), kept_rows, copy)

    def add_block(
        self,
        out: torch.Tensor,
        route: Route,
        block: torch.Tensor,
        rows: torch.Tensor | None = None,
        copy: bool = False,
    ) -> None:
        """Add one route's pooled block into its columns of the output: (batch, cols), or the
        batch rows `rows` of a compact layout. `copy`: copied instead (`fills_output`)."""
        start = self._out_start(route)
        if rows is None and copy:
            out[:, start : start + route.cols].copy_(block)
        elif rows is None:
            out[:, start : start + route.cols] += block
        else:
            out[:, start : start + route.cols].index_add_(0, rows, block)
