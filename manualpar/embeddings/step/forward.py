"""The forward phases of a sharded step: input dist, lookup, output dist.

Each exchange runs asynchronously and the compute that does not need it runs meanwhile: the
lookup looks this rank's own bags up while the other ranks' ids travel (started by input
dist), and groups every shard's rows for backward while the pooled rows travel back (collected
by output dist). Each phase takes the previous one's result, so a caller (a pipeline) may run
them apart. Each times itself into `self.times` while it is on (phase_times.py); the waits for
the ids count as their exchange, wherever they happen.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.kernels.bags import group_rows
from manualpar.embeddings.step.bag_expansion import FeatureBags, bag_lengths
from manualpar.embeddings.step.batched_tables import BatchedTables
from manualpar.embeddings.step.data_parallel import DataParallelTables
from manualpar.embeddings.step.exchange import SenderBags, combine_senders
from manualpar.embeddings.step.frozen import agreed_frozen, frozen_tables, frozen_to_words
from manualpar.embeddings.step.ids_exchange import IdsExchange
from manualpar.embeddings.step.owner_remap import remap_senders
from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.pooled_rows import add_own_pooled, send_pooled
from manualpar.embeddings.step.results import FetchedRows, LookedUp, RoutedIds, SavedForBackward
from manualpar.embeddings.step.scales import mean_features, pooling_scale, sender_scales
from manualpar.embeddings.step.size_header import (
    VARIABLE,
    WEIGHTED,
    check_refusals,
    size_header,
)
from manualpar.embeddings.step.wire import start_on_wire
from manualpar.embeddings.storage.disk_tier import CacheTooSmall
from manualpar.embeddings.storage.tier import Pins
from manualpar.phase_times import (
    IDS_EXCHANGE,
    LOOKUP,
    POOLED_EXCHANGE,
    PhaseTimes,
    timed,
)

__all__ = ["ForwardPhases", "sender_scales"]


class ForwardPhases:
    def __init__(
        self,
        parts: StepParts,
        data_parallel: DataParallelTables,
        batched: BatchedTables | None = None,
        warn_uneven: bool = True,
    ) -> None:
        self.parts = parts
        self.data_parallel = data_parallel
        self.batched = batched or BatchedTables(parts)  # many tables, one call each phase
        # say once when uneven batches are averaged per rank; `warn_uneven` False: the bags
        # are not samples (a sequence collection's padded ids)
        self.warn_uneven = warn_uneven and parts.normalize_by == "world_size"
        self.fetches_ahead = True  # False once a batch's rows did not fit beside the pinned
        self.times = PhaseTimes(parts.device)  # ShardedStep.phase_times
        self.wire = torch.float32  # the pooled outputs' wire dtype (wire.py)
        self.names = parts.table_names()  # fixed by the plan, as the mean-pooled features
        self.means = mean_features(parts.routing)
        self.ids_exchange = IdsExchange(parts)  # sizes and ids, and each pair's room

    def __call__(self, features: SparseFeatures) -> tuple[torch.Tensor, SavedForBackward]:
        """Pooled values (batch, total dim) of this rank's batch, and what backward needs."""
        return self.output_dist(self.lookup(self.input_dist(features)))

    # input dist -------------------------------------------------------------------------------
    @timed(IDS_EXCHANGE)
    def input_dist(self, features: SparseFeatures) -> RoutedIds:
        """Agree on sizes and frozen tables (blocking: one small exchange over the job), then
        start sending each owner the bags it serves (or send both in one exchange, waited for:
        ids_exchange.py)."""
        parts, layout = self.parts, self.parts.layout
        rank = parts.routing.rank
        features = features.without_unread_bags()  # rows no sample reads stay untouched
        bags = FeatureBags.of(features)  # a batch per feature: its bags travel, not samples
        lengths, per_sample = bag_lengths(features, bags)
        weighted = features.weights is not None
        packed = layout.pack_ids(features, lengths, bags)
        payloads = packed.payloads
        names = self.names
        flags = frozen_to_words(frozen_tables(parts.tables, names), len(names))
        header = size_header(features.batch_size, payloads, weighted, flags, bags.variable)
        # the sizes, then the ids (the others' payloads packed as one slice): one all_to_all
        # where every rank's payloads were short on the step before (ids_exchange.py)
        headers, ids_in = self.ids_exchange.exchange(header, payloads, packed.send)
        check_refusals(headers)
        frozen = agreed_frozen([h[3:] for h in headers], names)
        sizes = [headers[g][:3] for g in parts.mesh.group_ranks]
        job_batches = [h[0] for h in headers]
        if self.warn_uneven and len(set(job_batches)) > 1:
            self._warn_uneven(job_batches)
        kept = layout.kept_bags(payloads, features.batch_size, bags.variable)
        own = payloads[rank]  # cut into bags by the lookup, or read in place (the table batch)
        return RoutedIds(features, per_sample, sizes, own, ids_in, frozen, job_batches, bags, kept)

    def _warn_uneven(self, batches: list[int]) -> None:
        """Once per collection: under normalize_by="world_size" each rank's loss counts the
        same, so the samples of a smaller batch weigh more (as with plain DDP)."""
        self.warn_uneven = False
        if self.parts.routing.rank != 0 or not max(batches):
            return
        listed = ", ".join(f"rank {r}: {b}" for r, b in enumerate(batches))
        heaviest = max(batches) / max(min(batches), 1)
        warnings.warn(
            f"{BUILDER}: the ranks' batches differ ({listed}) under normalize_by='world_size': "
            "every rank's loss counts the same, so a sample of a smaller batch weighs more "
            f"(here up to {heaviest:.3g}x). Pass normalize_by='global_samples' (to "
            "shard_embeddings and ddp) to weigh every sample the same, or keep batches even; "
            "said once",
            stacklevel=2,
        )

    # fetch (a pipeline's, a step early) -----------------------------------------------------
    @timed(LOOKUP)
    def fetch(self, routed: RoutedIds) -> RoutedIds:
        """A prefetched batch's rows mapped to slots now, before the current step, where a block
        reads its rows in (a disk tier: read into the cache and pinned until this batch's
        backward). Waits for its ids. Nothing a step writes is read early: a row of this batch
        that the current step updates is the same pinned slot, updated in place. Left to the
        lookup (`routed` unchanged) where no block reads rows, where raw ids are remapped at
        their owner (the remap would run a batch ahead), and from the first batch whose rows
        the cache cannot hold beside the pinned ones on (said once): a later batch read ahead
        could otherwise leave no room for the rows of the one before it."""
        parts = self.parts
        stores = parts.stores
        if not (self.fetches_ahead and stores.reads_rows) or parts.owner_remap is not None:
            return routed
        local = parts.routing.routed_local_shards()
        senders = self._senders(routed, wait=True)
        pins: Pins = []
        stores.begin_step()
        try:
            for sender in self._own_first():
                senders[sender] = stores.to_slots(local, senders[sender], pins)
        except CacheTooSmall as full:  # its pins are released: the lookup maps them instead
            self._warn_cache(full)
            return routed
        return replace(routed, fetched=FetchedRows(senders, pins, stores))

    def _warn_cache(self, full: CacheTooSmall) -> None:
        self.fetches_ahead = False
        warnings.warn(
            f"{BUILDER}: prefetched batches' rows are read in their own step from now on, not "
            f"ahead: {full}",
            stacklevel=3,
        )

    # lookup -----------------------------------------------------------------------------------
    @timed(LOOKUP)
    def lookup(self, routed: RoutedIds) -> LookedUp:
        """Map rows to slots (storage), look up this rank's own bags while the others' ids
        travel, then the others' bags, and send them their pooled rows. Raw ids of tables
        remapped here (owner_remap.py) become rows first, every sender's at once, so then the
        own bags wait for the others' ids. A batch fetched ahead has its slots already."""
        self.batched.guard.check()  # a weight replaced by another shape or dtype: an error
        parts = self.parts
        routing, stores = parts.routing, parts.stores
        rank, batch = routing.rank, routed.batch
        local = routing.routed_local_shards()
        # every column written once: copied into an unfilled output, not added into zeros
        fills = parts.layout.fills_output(routed.kept, self.wire)
        new = torch.empty if fills else torch.zeros
        out = new(batch, routing.total_dim, dtype=parts.dtype, device=parts.device)
        if routed.fetched is not None:
            senders, pins = routed.fetched.senders, routed.fetched.pins
            add_own_pooled(parts, senders[rank], out, routed.bags, fills)
            return self._send_and_group(routed, senders, out, pins, fills)
        if self.batched.takes(routed):
            return self._lookup_batched(routed, out, fills)
        pins = []  # slots held from here to the step's backward
        stores.begin_step()
        remap = parts.owner_remap
        remaps_here = remap is not None and any(s.table in remap.tables for s in local)
        # raw ids remapped here, all senders' at once: wait for them first
        senders = self._senders(routed, wait=remaps_here)
        if remap is not None:
            remap_senders(remap, local, senders)
        senders[rank] = stores.to_slots(local, senders[rank], pins)
        add_own_pooled(parts, senders[rank], out, routed.bags, fills)  # while the others' travel
        try:
            if not remaps_here:
                self._unpack_others(self._ids_in(routed), routed.sizes, senders)
            for sender in self._own_first()[1:]:
                senders[sender] = stores.to_slots(local, senders[sender], pins)
        except Exception:
            stores.release(pins, updated=False)
            raise
        return self._send_and_group(routed, senders, out, pins, fills)

    def _lookup_batched(self, routed: RoutedIds, out: torch.Tensor, fills: bool) -> LookedUp:
        """The lookup with every table in one call per sender group (batched_tables.py), each
        sender's bags read in place from its payload: our own while the others' ids travel,
        then theirs, sent back, and the rows grouped while they travel. Slots are rows here:
        nothing is mapped or pinned. `fills`: `out` is unfilled, and our own columns are written
        by the batch (zeroed first where two tables share columns: it adds into them)."""
        parts, batched = self.parts, self.batched
        routing = parts.routing
        rank, world = routing.rank, routing.world_size
        parts.stores.begin_step()
        if fills and not batched.assigns_own(out):
            parts.layout.zero_own(out)
        own = batched.sender_bags(routed.own_payload, routed.sizes[rank][0], compact=False)
        batched.pool_own(own, out, fills)
        batch = batched.batch(batched.every_sender(own, self._ids_in(routed), routed.sizes))
        pooled_in = None
        if world > 1:
            flat, splits = batched.pool_others(batch, out)
            receive = parts.layout.output_splits(routed.bags.counts, routed.kept)
            bound = torch.finfo(self.wire).max
            pooled_in = start_on_wire(
                parts,
                flat,
                splits,
                receive,
                "pooled output",
                self.wire,
                lambda: batched.beyond(batch, flat, bound),
            )
        batched.group(batch)  # while the pooled rows travel
        counts = [[batch.counts[s][k] for s in range(world)] for k in range(len(batched.local))]
        return LookedUp(routed, out, [], pooled_in, [], counts, batch, fills)

    def _senders(self, routed: RoutedIds, wait: bool) -> list[list[SenderBags]]:
        """Every sender's bags for this rank's shards: ours, and (`wait`) the others' once
        they arrived."""
        senders: list[list[SenderBags]] = [[] for _ in range(self.parts.routing.world_size)]
        senders[self.parts.routing.rank] = self.parts.layout.unpack_ids(
            routed.own_payload,
            routed.bags.batch,
            routed.features.weights is not None,
            variable=routed.bags.variable,
        )
        if wait:
            self._unpack_others(self._ids_in(routed), routed.sizes, senders)
        return senders

    def _ids_in(self, routed: RoutedIds) -> torch.Tensor:
        """The other ranks' ids for our shards, once arrived (the wait is their exchange's)."""
        with self.times.phase(IDS_EXCHANGE):
            return routed.ids_in.wait()

    def _own_first(self) -> list[int]:
        """Sender ranks, this one first (its bags are looked up while the others' travel)."""
        rank, world = self.parts.routing.rank, self.parts.routing.world_size
        return [rank, *(s for s in range(world) if s != rank)]

    def _send_and_group(
        self,
        routed: RoutedIds,
        senders: list[list[SenderBags]],
        out: torch.Tensor,
        pins: Pins,
        fills: bool,
    ) -> LookedUp:
        """Send the other ranks their pooled rows, then group each shard's rows for backward
        while they travel."""
        parts = self.parts
        routing = parts.routing
        rank, world = routing.rank, routing.world_size
        local = routing.routed_local_shards()
        pooled_in = send_pooled(parts, senders, out, routed, self.wire) if world > 1 else None
        bag_counts = [[senders[s][k][1].numel() for s in range(world)] for k in range(len(local))]
        bags = [
            combine_senders([senders[s][k] for s in range(world)], rank) for k in range(len(local))
        ]
        if parts.fuses_bags:  # while the pooled rows travel
            for shard, shard_bags in zip(local, bags, strict=True):
                if shard.table not in routed.frozen:
                    shard_bags.groups = group_rows(shard_bags, parts.block_rows(shard))
        return LookedUp(routed, out, bags, pooled_in, pins, bag_counts, fills=fills)

    def _unpack_others(
        self, received: torch.Tensor, sizes: list[list[int]], senders: list[list[SenderBags]]
    ) -> None:
        layout, rank = self.parts.layout, self.parts.routing.rank
        offset = 0
        for sender, (batch, length, bits) in enumerate(sizes):
            if sender != rank:
                payload = received[offset : offset + length]
                senders[sender] = layout.unpack_ids(
                    payload,
                    batch,
                    bool(bits & WEIGHTED),
                    layout.compacts(bool(bits & VARIABLE)),
                    bool(bits & VARIABLE),
                )
                offset += length

    # output dist ------------------------------------------------------------------------------
    @timed(POOLED_EXCHANGE)
    def output_dist(self, looked: LookedUp) -> tuple[torch.Tensor, SavedForBackward]:
        """Add the pooled rows the other owners sent back, look up the data-parallel tables,
        apply mean pooling; returns the output and what backward needs."""
        parts, routed, out = self.parts, looked.routed, looked.out
        layout = parts.layout
        if looked.pooled_in is not None:
            try:
                received = looked.pooled_in.wait()
            except BaseException:  # e.g. values beyond the wire dtype: nothing left pinned
                parts.stores.release(looked.pins, updated=False)
                raise
            offset = 0
            kept = routed.kept
            bags = routed.bags
            for owner, size in enumerate(layout.output_splits(bags.counts, kept)):
                if size:  # each bag's rows expanded to the batch
                    part = received[offset : offset + size]
                    owner_kept = None if kept is None else kept[owner]
                    layout.add_pooled(out, owner, part, bags, owner_kept, looked.fills)
                offset += size
        with self.times.phase(LOOKUP):  # the data-parallel tables' own lookup
            feature_ids = self.data_parallel.lookup(routed.features, out, routed.bags)
        mean_scale = pooling_scale(parts.routing, self.means, routed.lengths, out.dtype)
        if mean_scale is not None:
            out.mul_(mean_scale)
        batch_sizes = [size[0] for size in routed.sizes]
        return out, SavedForBackward(
            bags=looked.bags,
            batch_sizes=batch_sizes,
            scales=sender_scales(parts.normalize_by, batch_sizes, routed.job_batches),
            feature_ids=feature_ids,
            mean_scale=mean_scale,
            frozen=routed.frozen,
            trains=len(routed.frozen) < len(parts.routing.tables),
            pins=looked.pins,
            bag_counts=looked.bag_counts,
            kept=routed.kept,
            batch=looked.batch,
            feature_bags=routed.bags,
        )
