"""The backward phases of a sharded step: gradient dist, then the fused update.

Gradient dist sends each owner the output gradient of the bags it served, each rank's
non-finite flag after it, and cuts out this rank's own. A step whose gradient holds NaN or inf
updates nothing (finite_check.py), so the update waits for every rank's flag: where the flags
ride with the gradients (the usual case) it runs once they arrived, in one fused pass over
every row (RowPass.ALL); where they travel in an all_reduce of their own (2-D replicas, SGD's
guarded half rows), it applies, while the other ranks' gradients travel, the rows that only this
rank's own bags touched (RowPass.OWN), and once they arrive the rest (RowPass.REST). Either
way every row is updated once, with its whole gradient: the numbers are those of a sequential
step. Rules that need the summed rows first (clipping, 2-D replicas) take the row-sum path
instead (row_sums.py). Frozen tables are left out. A step whose half rows overflow is undone
(half_overflow.py: rows are copied aside only when a rank cannot rule that out); while the
Trainer holds a step open, each update stays undoable until it decides (update_journal.py).
Each phase times itself into `self.times` while it is on (phase_times.py); the update's waits
for the gradients (and the non-finite flags) count as the gradient exchange.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from manualpar.embeddings.kernels.bags import BagGradients, RowPass, ShardBags, row_gradients
from manualpar.embeddings.step.bag_expansion import OutputGrad
from manualpar.embeddings.step.batched_tables import BatchedTables
from manualpar.embeddings.step.data_parallel import DataParallelTables
from manualpar.embeddings.step.finite_check import FiniteCheck, Flags, RiddenFlags
from manualpar.embeddings.step.half_overflow import HalfRowsGuard, half_rows_guard
from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.results import RoutedGradients, SavedForBackward
from manualpar.embeddings.step.routing import LocalShard
from manualpar.embeddings.step.row_sums import RowSums, row_sum_update
from manualpar.embeddings.step.update_journal import UpdateJournal
from manualpar.embeddings.step.wire import Arriving, start_on_wire
from manualpar.phase_times import GRAD_EXCHANGE, UPDATE, PhaseTimes, timed

__all__ = ["BackwardPhases"]


class BackwardPhases:
    def __init__(
        self,
        parts: StepParts,
        data_parallel: DataParallelTables,
        non_finite: str = "raise",
        batched: BatchedTables | None = None,
    ) -> None:
        self.parts = parts
        self.data_parallel = data_parallel
        self.batched = batched or BatchedTables(parts)  # the forward's, when it batched
        self.apply_row_sums = row_sum_update(parts)
        self.finite = FiniteCheck(parts, non_finite)
        self.half_rows: HalfRowsGuard | None = None  # guard_half_rows() sets it
        self.journal = UpdateJournal(parts)
        self.times = PhaseTimes(parts.device)  # ShardedStep.phase_times
        self.wire = torch.float32  # the output gradients' wire dtype (wire.py)
        routing = parts.routing
        self._routed = frozenset(route.table for routes in routing.routes_to for route in routes)
        self._receive: list[int] = []  # the last gradient exchange's receive splits

    def guard_half_rows(self, copy_always: bool = True) -> None:
        """Undo and report updates that overflow half rows (half_overflow.py); unless
        `copy_always`, only where the rule's steps are bounded (Adam with `b2 = 0` has no
        bound: it would copy the touched rows every step)."""
        guard = half_rows_guard(self.parts, self.finite)
        self.half_rows = guard if guard is not None and (copy_always or guard.bounded) else None

    def __call__(self, grad: torch.Tensor, saved: SavedForBackward) -> None:
        """Send the output gradient to the shards' owners and update our shards with theirs."""
        self.update(self.gradient_dist(grad, saved), saved)

    # gradient dist ----------------------------------------------------------------------------
    @timed(GRAD_EXCHANGE)
    def gradient_dist(self, grad: torch.Tensor, saved: SavedForBackward) -> RoutedGradients:
        """Start sending each owner the gradient of the bags it served (none for frozen
        tables), and cut out this rank's own blocks."""
        parts = self.parts
        routing, layout = parts.routing, parts.layout
        full, frozen = parts.optimizer.needs_full_rows, saved.frozen
        if saved.mean_scale is not None:
            grad = grad * saved.mean_scale
        guard = self.half_rows if self.half_rows and self.half_rows.applies(frozen) else None
        exchanges = not self._routed <= frozen  # every rank agrees: frozen is the same everywhere
        flag = self.finite.flag(grad, frozen)
        # a weight replaced since the lookup: every rank's error at this backward's update
        frozen_names = [parts.name(t) for t in frozen]
        flag = self.finite.replaced(flag, lambda: self.batched.guard.unchanged(frozen_names))
        pending = None  # the flags' all_reduce, where their ride does not reach every rank
        # (or a half-row guard needs the job's sums: SGD's, half_overflow.py)
        rides = exchanges and not parts.mesh.combines and (guard is None or guard.rides)
        if not rides:
            # first: collectives on a group complete in the order they start, so the tiny flag
            # exchange must not queue behind the gradients (waiting for it would then wait for
            # them too, and the own rows' update would no longer overlap their travel)
            riders = None if guard is None else guard.answers(grad, saved)
            pending = self.finite.start(flag, riders)  # can half rows overflow? Answered too
        elif guard is not None:  # raised too where this rank cannot rule an overflow out
            flag = guard.ridden_flag(flag, grad, saved)
        by_bag = OutputGrad(grad, routing, saved.feature_bags)  # summed back onto bags
        grads_in: Arriving | None = None
        non_finite: Flags | None = pending
        if exchanges:  # each rank's flag rides after its gradient for every other rank
            grads_in = _Once(self._start_grads(by_bag, saved, flag))
            if pending is None:  # ... and decides
                ends = list(accumulate(self._receive))
                ends = [end - 1 for sender, end in enumerate(ends) if sender != routing.rank]
                non_finite = RiddenFlags(flag, grads_in, ends)
        assert non_finite is not None
        if saved.batch is not None:  # the table batch: no table frozen, views suffice
            own = self.batched.own_blocks(by_bag)
        else:
            own = layout.own_grad_blocks(by_bag, full, frozen)
        return RoutedGradients(grad, own, grads_in, non_finite, by_bag)

    def _start_grads(
        self, by_bag: OutputGrad, saved: SavedForBackward, flag: torch.Tensor
    ) -> Arriving:
        """Start sending the other owners their gradient blocks, `flag` after each's."""
        parts, full, frozen = self.parts, self.parts.optimizer.needs_full_rows, saved.frozen
        layout = parts.layout
        flat, splits = layout.pack_output_grad(by_bag, full, frozen, saved.kept, flag)
        self._receive = layout.grad_receive_splits(saved.bag_counts, full, frozen, 1)
        return start_on_wire(parts, flat, splits, self._receive, "output gradient", self.wire)

    # update -----------------------------------------------------------------------------------
    @timed(UPDATE)
    def update(self, routed: RoutedGradients, saved: SavedForBackward) -> None:
        """Apply the rule to every row this step touched, then release the step's slots."""
        parts = self.parts
        routing, optimizer = parts.routing, parts.optimizer
        frozen, scales = saved.frozen, saved.scales
        try:
            with self.times.phase(GRAD_EXCHANGE):  # waits for every rank's flags (a weight
                finite = self.finite.passed(routed.non_finite)  # replaced on one: its error)
        except BaseException:
            self._drop(routed, saved)
            raise
        if not finite:
            self._drop(routed, saved)
            return
        guard = self.half_rows if self.half_rows and self.half_rows.applies(frozen) else None
        copy = False  # the same answer on every rank
        if guard is not None:
            copy = guard.needs_copy(saved, routed.non_finite)
        before = guard.save(saved) if guard and copy else []
        self.journal.record(saved)
        optimizer.begin_update()
        own_scale = scales[routing.rank]
        if saved.batch is not None:
            self._update_batched(routed, saved)
        else:
            self._update_tables(routed, saved)
        by_bag = routed.by_bag or OutputGrad(routed.grad, routing)
        self.data_parallel.update(by_bag, saved.feature_ids, own_scale, frozen)
        optimizer.finish_update(parts.strategy, group=parts.mesh.shard)
        try:
            kept = guard.passed(before) if guard and copy else True  # False: rows put back
        except BaseException:
            parts.stores.release(saved.pins, updated=False)  # put back as they were
            raise
        if guard is not None and kept:
            guard.kept()
        if not kept:
            self.journal.forget_last()  # already undone, count included
        if not self.journal.hold(saved.pins, kept):
            parts.stores.release(saved.pins, updated=kept)  # written through the slots

    def _update_batched(self, routed: RoutedGradients, saved: SavedForBackward) -> None:
        """Every table in one fused pass: the rows only our own bags touched while the other
        ranks' gradients travel, then the rest (batched_tables.py); every row in one pass
        where they have arrived (the flags rode with them) or there are none (alone)."""
        batch, scales = saved.batch, saved.scales
        assert batch is not None
        if self.parts.routing.world_size == 1:  # alone: every row is our own bags'
            self.batched.update(batch, routed.own, None, scales, RowPass.ALL)
            return
        arrived = isinstance(routed.non_finite, RiddenFlags)
        if not arrived:
            self.batched.update(batch, routed.own, None, scales, RowPass.OWN)
        others = self._other_blocks(routed, saved)
        rows = RowPass.ALL if arrived else RowPass.REST
        self.batched.update(batch, routed.own, others, scales, rows)

    def _other_blocks(
        self, routed: RoutedGradients, saved: SavedForBackward
    ) -> list[list[torch.Tensor | None]]:
        """Per local shard, per sender: the gradient it sent (once arrived; None for ourselves
        and frozen tables), read around the flag after each sender's."""
        if routed.grads_in is None:
            return []
        full = self.parts.optimizer.needs_full_rows
        received = self._grads_in(routed)
        return self.parts.layout.grad_blocks(received, saved.bag_counts, full, saved.frozen, 1)

    def _update_tables(self, routed: RoutedGradients, saved: SavedForBackward) -> None:
        """Table by table: the rule's fused pass, or the row sums (clipping, 2-D tables)."""
        parts = self.parts
        routing = parts.routing
        frozen, scales = saved.frozen, saved.scales
        local = routing.routed_local_shards()
        own_scale = scales[routing.rank]
        alone = routing.world_size == 1
        # every row at once where the others' gradients are here (the flags rode with them)
        arrived = isinstance(routed.non_finite, RiddenFlags)
        fusing = [
            shard.table not in frozen and not parts.mesh.combines  # replicas: row_sums.py
            for shard in local
        ]
        fused = [False] * len(local)
        if not arrived:  # while the other ranks' gradients travel: rows only our own bags touched
            for k in range(len(local)):
                if fusing[k]:
                    blocks = routed.own[k]
                    grads = BagGradients(blocks, [own_scale] * len(blocks))
                    rows = RowPass.ALL if alone else RowPass.OWN
                    fused[k] = self._step_bags(local[k], saved.bags[k], grads, rows)
        others = self._other_blocks(routed, saved)
        every = [self._every_sender(routed, others, k, scales) for k in range(len(local))]
        if arrived or not alone:
            rows = RowPass.ALL if arrived else RowPass.REST
            for k in range(len(local)):
                if fusing[k] and (arrived or fused[k]):
                    fused[k] = self._step_bags(local[k], saved.bags[k], every[k], rows)
        summed_rows: RowSums = []  # in table order: clipping sums their norms in it
        for k, (shard, bags) in enumerate(zip(local, saved.bags, strict=True)):
            if shard.table not in frozen and not fused[k]:
                bag_grads, scale = every[k].dense()
                rows_, summed = row_gradients(
                    bags.ids, bags.lengths, bags.weights, bag_grads, parts.block_rows(shard), scale
                )
                summed_rows.append((shard, (rows_, summed)))
        self.apply_row_sums(summed_rows)

    @staticmethod
    def _every_sender(
        routed: RoutedGradients,
        others: list[list[torch.Tensor | None]],
        k: int,
        scales: list[float],
    ) -> BagGradients:
        """Local shard k's gradients from every sender, in bag order (rank order)."""
        grads = BagGradients([], [])
        for sender, scale in enumerate(scales):
            other = others[k][sender] if others else None
            blocks = routed.own[k] if other is None else [other]
            grads.blocks += blocks
            grads.scales += [scale] * len(blocks)
        return grads

    def _drop(self, routed: RoutedGradients, saved: SavedForBackward) -> None:
        """A step that updates nothing: its exchange still completes, its slots are unpinned."""
        if routed.grads_in is not None:
            self._grads_in(routed)
        self.parts.stores.release(saved.pins, updated=False)

    def _grads_in(self, routed: RoutedGradients) -> torch.Tensor:
        """The other ranks' gradients for our shards, once arrived (the wait is their
        exchange's)."""
        assert routed.grads_in is not None
        with self.times.phase(GRAD_EXCHANGE):
            return routed.grads_in.wait()

    def _step_bags(
        self, shard: LocalShard, bags: ShardBags, grads: BagGradients, rows: RowPass
    ) -> bool:
        parts = self.parts
        return parts.optimizer.step_bags(
            parts.name(shard.table), parts.weight(shard.table), bags, grads, rows
        )


class _Once:
    """An exchange in flight whose wait gives the same tensor each time (the flags riding in
    it and the update both read it)."""

    def __init__(self, arriving: Arriving) -> None:
        self.arriving: Arriving | None = arriving
        self.arrived = torch.zeros(0)

    def wait(self) -> torch.Tensor:
        if self.arriving is not None:
            self.arrived, self.arriving = self.arriving.wait(), None
        return self.arrived
