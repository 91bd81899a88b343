"""The step's table batch: every routed table of this rank looked up, grouped and updated in one
kernel call each (kernels/table_batch.py), where the per-table calls of forward.py and
backward.py would cost more than the rows (many small tables).

`ShardedStep.batches_tables` chooses: None (the default) batches a step whose tables are small
(`SMALL`: ids times width per table; faster for many small tables with short bags, slower for
8 tables of 1M x 64 at 20 ids a bag; docs/benchmarks.md, "Many small tables"), True every step
that can, False none. A step batches its tables when all of them can be: float32 or float64
rows of one dtype whose slots are their rows (in memory: nothing read in, nothing pinned), a
rule with a table-batched pass (row-wise Adagrad without clipping, 1-D tables), no raw ids
remapped in the step, no compact layout (a row split's compact blocks are batched: each
sender's bags are counted as they came); and, per step, no per-id weights or batch per
feature (the size header's third value: step/size_header.py), no frozen table, no batch
fetched ahead.
Otherwise the step takes the per-table path, which gives the same bits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from manualpar.embeddings.kernels.bags import BagGradients, RowPass, ShardBags
from manualpar.embeddings.kernels.native import native_kernels_take
from manualpar.embeddings.kernels.table_batch import (
    BATCHED_DTYPES,
    Segments,
    TableBatch,
    group_batch,
    pool_tables,
)
from manualpar.embeddings.modules.bag_collection import table_weight
from manualpar.embeddings.step.bag_expansion import OutputGrad
from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.results import RoutedIds
from manualpar.embeddings.step.weight_guard import WeightGuard

__all__ = ["BatchPart", "BatchedTables"]

BatchPart = tuple[torch.Tensor, torch.Tensor, list[int]]  # a sender's ids, lengths, bags a table


@dataclass(frozen=True)
class _Counted:
    """What a batch's bag counts fix: its segments, the other senders' pooled rows' segments
    in one send buffer, the send splits and the buffer's size."""

    segments: torch.Tensor
    others: torch.Tensor
    splits: list[int]
    size: int


class BatchedTables:
    """This rank's routed tables as one batch: whether a step takes it, and its calls."""

    def __init__(self, parts: StepParts, guard: WeightGuard | None = None) -> None:
        self.parts = parts
        self.local = parts.routing.routed_local_shards()
        self.tables = [shard.table for shard in self.local]
        self.names = [parts.name(t) for t in self.tables]
        self._usable: bool | None = None  # decided at the first step (stores are final then)
        # every held block's weight, checked at each step's lookup (forward.py): one of another
        # shape or dtype is an error, one of the same is read again here (`usable`)
        self.guard = WeightGuard() if guard is None else guard
        self._decided = 0  # the guard's replacements when `_decide` read the weights
        # pool_own's segments, and whether their columns are apart (each written by one)
        self._own_cache: dict[tuple[int, int], tuple[torch.Tensor, bool]] = {}
        self._counted_cache: dict[tuple[tuple[int, ...], ...], _Counted] = {}  # batch's
        routing = parts.routing
        self._routes = len(routing.routes_to[routing.rank])  # routes (bag rows) per sender
        self._features = [len(shard.features) for shard in self.local]  # bags per table: x batch
        # a row-split table's bags from other senders travel compact (exchange.py)
        self._compacts = any(t in parts.layout.compact_tables for t in self.tables)
        self._spans: list[list[tuple[int, int, int]]] | None = None  # own_blocks' columns
        # None: steps whose tables are small (`SMALL`); True: every step that can; False: none
        self.enabled: bool | None = None
        self._widths = sum(shard.shard.cols for shard in self.local)  # `_small`'s

    # the batch's per-table saving is fixed (a Python call chain and kernel calls per table), its
    # cost grows with the rows (one sort and pass over every table's ids): per 2-rank step, 26
    # tables of 200k x 16 at 1 id a bag (6.6e4 elements a table) take 0.8-0.9x the per-table CPU
    # time, 8 tables of 1M x 64 at 20 ids a bag (2.8e6) 1.2-1.5x. Batched up to this many
    # (ids and bag lengths received) x (columns) per table and step, about their geometric middle.
    SMALL = 1 << 19

    @property
    def usable(self) -> bool:
        """Whether this rank's tables can take the batch (see the module docstring): decided
        again where a table's weight was replaced since: a new Parameter (`module.weight =
        ...`, load_state_dict(assign=True)) or new data under the same one (`.data =`, `to()`),
        which the guard (weight_guard.py) counts. The batch would look up and update the old
        tensors (the per-table path reads the weights every step)."""
        if self._usable is None or self._decided != self.guard.replacements:
            self._decided = self.guard.replacements
            self._usable = self._decide()
        return self._usable

    def _decide(self) -> bool:
        parts = self.parts
        if not self.local or parts.owner_remap is not None or parts.layout.compact:
            return False
        if not (parts.fuses_bags and parts.optimizer.batches_tables):
            return False
        stores = [parts.stores.stores[t] for t in self.tables]
        if any(store.reads_rows or store.slot_rows is not None for store in stores):
            return False  # slots are not rows (a cache): the per-table path maps them
        self.weights = [table_weight(parts.tables, name).detach() for name in self.names]
        dtypes = {weight.dtype for weight in self.weights}
        if len(dtypes) != 1 or dtypes.pop() not in BATCHED_DTYPES:
            return False
        full = parts.optimizer.needs_full_rows
        self.widths = [parts.layout.grad_width(shard, full) for shard in self.local]
        rows = [weight.shape[0] for weight in self.weights]
        self.row_offsets = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
        return all(w.is_contiguous() for w in self.weights) and native_kernels_take(*self.weights)

    def takes(self, routed: RoutedIds) -> bool:
        """Whether this step batches its tables (decided by every rank alike: the exchange
        layout is the same either way)."""
        return (
            self.enabled is not False
            and routed.fetched is None
            and routed.features.weights is None
            and not any(size[2] for size in routed.sizes)
            and routed.frozen.isdisjoint(self.tables)
            and self.usable
            and (self.enabled or self._small(routed))
        )

    def _small(self, routed: RoutedIds) -> bool:
        """Whether this step's tables are small enough to batch (`SMALL`): by the payload every
        sender's size header announced (bag lengths and ids), so no tensor is read."""
        payload = sum(size[1] for size in routed.sizes)
        tables = len(self.local)
        return payload * self._widths <= self.SMALL * tables * tables

    # forward ----------------------------------------------------------------------------------
    def sender_bags(self, payload: torch.Tensor, batch: int, compact: bool) -> BatchPart:
        """One sender's bags of this rank's tables, read in place from its payload (exchange.py:
        bag lengths, then ids; a batched step has no per-id weights): (ids, lengths, bags per
        table). `compact`: its bags without ids in a row-split table are left out (unpack_ids'
        compact cut), so the payload is cut per table and joined again."""
        lengths = payload[: self._routes * batch]
        if compact and self._compacts:
            cut = self.parts.layout.unpack_ids(payload, batch, False, True)
            ids, lens = torch.cat([b[0] for b in cut]), torch.cat([b[1] for b in cut])
            return ids, lens, [b[1].numel() for b in cut]
        return payload[lengths.numel() :], lengths, [batch * n for n in self._features]

    def every_sender(
        self, own: BatchPart, received: torch.Tensor, sizes: list[list[int]]
    ) -> list[BatchPart]:
        """Every sender's bags in rank order: ours (`own`), and the others' from their payloads
        in `received` (`sizes`: every sender's [batch, payload length, bits])."""
        rank = self.parts.routing.rank
        compact = self.parts.layout.compacts(False)
        senders = []
        offset = 0
        for sender, (batch, length, _) in enumerate(sizes):
            if sender == rank:
                senders.append(own)
                continue
            senders.append(self.sender_bags(received[offset : offset + length], batch, compact))
            offset += length
        return senders

    def pool_own(self, own: BatchPart, out: torch.Tensor, fills: bool = False) -> None:
        """Look this rank's own bags (`sender_bags`') up straight into its output columns (one
        call). `fills`: `out` is unfilled; where no two tables share columns (`assigns_own`)
        the pooled rows are written, not added, so no zeros are written first; else the caller
        zeroes the columns first."""
        segments, apart = self._own_segments(out)
        pool_tables(self.weights, own[0], own[1], segments, [out], fills and apart)

    def assigns_own(self, out: torch.Tensor) -> bool:
        """Whether `pool_own(..., fills=True)` writes our own columns of `out` whole."""
        return self._own_segments(out)[1]

    def _own_segments(self, out: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Where our own bags' pooled rows go in `out`, and whether no two segments share a
        column: fixed by its shape, so made once per (batch, row stride) and kept (the step's
        batch rarely changes)."""
        key = (out.shape[0], out.stride(0))
        found = self._own_cache.get(key)
        if found is None:
            routing = self.parts.routing
            segments = Segments()
            spans = []
            for k, shard in enumerate(self.local):
                for f in shard.features:
                    start = routing.feature_offsets[f] + shard.shard.col_start
                    segments.add(k, key[0], 0, start, key[1])
                    spans.append((start, start + shard.shard.cols))
            spans.sort()
            apart = all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
            found = (segments.tensor(), apart)
            if len(self._own_cache) >= 8:
                self._own_cache.clear()
            self._own_cache[key] = found
        return found

    def batch(self, senders: list[BatchPart]) -> TableBatch:
        """Every sender's bags (`sender_bags`', in rank order) as one batch, in (sender, table)
        order: each sender's ids and lengths lie whole in its payload, so one join each."""
        rank = self.parts.routing.rank
        counts = [sender[2] for sender in senders]
        own_begin = sum(sum(c) for c in counts[:rank])
        ids = senders[0][0] if len(senders) == 1 else torch.cat([s[0] for s in senders])
        lengths = senders[0][1] if len(senders) == 1 else torch.cat([s[1] for s in senders])
        shard_bags = ShardBags(ids, lengths, None, own_begin, own_begin + sum(counts[rank]))
        return TableBatch(shard_bags, self._counted(counts).segments, self.row_offsets, counts)

    def _counted(self, counts: list[list[int]]) -> _Counted:
        """The segments of a batch of these bag counts (fixed by them: made once and kept)."""
        key = tuple(tuple(c) for c in counts)
        found = self._counted_cache.get(key)
        if found is None:
            rank = self.parts.routing.rank
            segments, others = Segments(), Segments()
            splits = []
            offset = 0
            for sender, sender_counts in enumerate(counts):
                start = offset
                for k, bags in enumerate(sender_counts):
                    segments.add(k, bags)
                    if sender == rank:
                        others.bags += bags  # looked up already (pool_own)
                        continue
                    cols = self.local[k].shard.cols
                    others.add(k, bags, 0, offset, cols)
                    offset += bags * cols
                splits.append(offset - start)
            found = _Counted(segments.tensor(), others.tensor(), splits, offset)
            if len(self._counted_cache) >= 8:
                self._counted_cache.clear()
            self._counted_cache[key] = found
        return found

    def pool_others(self, batch: TableBatch, like: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The other senders' pooled rows, in one buffer by destination (as pack_pooled lays
        them out), and the send splits (0 to ourselves)."""
        counted = self._counted(batch.counts)
        flat = like.new_empty(counted.size)  # every element written (the segments tile it)
        every = batch.bags
        pool_tables(self.weights, every.ids, every.lengths, counted.others, [flat], assign=True)
        return flat, list(counted.splits)

    def beyond(self, batch: TableBatch, flat: torch.Tensor, bound: float) -> list[str]:
        """The tables whose pooled rows in `flat` exceed `bound` (an overflow's error)."""
        rank = self.parts.routing.rank
        found = set()
        offset = 0
        for sender, sender_counts in enumerate(batch.counts):
            if sender == rank:
                continue
            for k, bags in enumerate(sender_counts):
                size = bags * self.local[k].shard.cols
                if bool((flat[offset : offset + size].abs() > bound).any()):
                    found.add(self.names[k])
                offset += size
        return sorted(found)

    @staticmethod
    def group(batch: TableBatch) -> None:
        group_batch(batch)

    # backward ---------------------------------------------------------------------------------
    def own_blocks(self, grad: OutputGrad) -> list[list[torch.Tensor]]:
        """Per table, the gradient of our own bags: (batch, width) column views of the output
        gradient, one per feature. Not copied out (as the per-table path does, to keep one
        table's rows close while it is updated): the batched update reads every table's rows
        at random at once, from the whole gradient either way, and the copies took about 0.9 ms
        of a 26-table step."""
        spans = self._own_spans()
        if grad.bags is None or not grad.bags.variable:  # a plain batch: column views
            whole = grad.grad
            return [[whole[:, start:end] for _, start, end in table] for table in spans]
        return [[grad.columns(f, start, end) for f, start, end in table] for table in spans]

    def _own_spans(self) -> list[list[tuple[int, int, int]]]:
        """Per table, per feature: (feature, first column, end column) of our own gradient
        blocks (fixed by the routing and the rule: made once)."""
        if self._spans is None:
            layout, routing = self.parts.layout, self.parts.routing
            full = self.parts.optimizer.needs_full_rows
            routes = iter(routing.routes_to[routing.rank])
            spans = []
            for shard in self.local:
                table = []
                for _ in shard.features:
                    route = next(routes)
                    table.append((route.feature, *layout.grad_columns(route, full)))
                spans.append(table)
            self._spans = spans
        return self._spans

    def update(
        self,
        batch: TableBatch,
        own: list[list[torch.Tensor]],
        others: list[list[torch.Tensor | None]] | None,
        scales: list[float],
        rows: RowPass,
    ) -> None:
        """One fused pass over every table: the rows of `rows` (OWN: from `own`, this rank's
        own blocks per table; else every sender's, `others[k][sender]` the others')."""
        rank = self.parts.routing.rank
        grads = BagGradients([], [])
        senders = [rank] if rows is RowPass.OWN else range(len(scales))
        for sender in senders:
            for k in range(len(self.local)):
                other = None if others is None else others[k][sender]
                blocks = own[k] if other is None else [other]
                grads.blocks += blocks
                grads.scales += [scales[sender]] * len(blocks)
        self.parts.optimizer.step_tables(self.names, self.weights, batch, grads, self.widths, rows)
