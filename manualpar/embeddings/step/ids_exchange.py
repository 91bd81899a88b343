"""The size header and the ids in one all_to_all (exchange.py, 1 and 2 folded into one call).

Every rank sends every other rank of the shard group the first `room` values of the ids payload
it has for it (zeros after a shorter payload) and then its size header (size_header.py; behind
the ids, so that they start the receive buffer where one rank sends them, aligned). Each
ordered pair of ranks has its own room, and both of its ends derive it from the same history:
the lengths that pair's payloads had on its last steps (the sender knows what it sent, the
receiver reads it in the header). So every rank knows every split before anything arrives, and
the step opens with one collective, not two. A payload longer than its room sends the rest
point-to-point right after the all_to_all starts; its receiver reads the length in the header
and receives the rest. Only that pair takes part, so the other ranks never wait on it.

Every transfer completes before anything is checked: a rank that refused its batch (REFUSED in
its header) still receives the others' payloads, and a refusal or a frozen-table disagreement
then stops every rank at the same step, with no transfer left pending to meet the next step's.

A step folds only where every rank of the group asked for it in the step before (FOLDS in its
header, which every rank receives from every rank: all decide alike), and a rank asks only
while its payloads are short (FOLD_MAX): a long payload is better sent apart, travelling while
the lookup of the own bags runs. The separate size exchange (StepParts.exchange_headers, then
the ids) remains on the first step (so a single step's exchanges are those the planner prices),
after a step with a long payload, and where the sizes must reach ranks outside the shard group
(a 2-D mesh's replicas).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.exchange_layout import FOLD_MAX
from manualpar.embeddings.step.size_header import FOLDS, REFUSED, header_width
from manualpar.strategy.collectives import PendingCollective

if TYPE_CHECKING:
    from manualpar.embeddings.step.parts import StepParts

__all__ = ["FOLD_MAX", "HISTORY", "IdsExchange", "room"]

HISTORY = 8  # steps of a pair's payload lengths its room is derived from
# FOLD_MAX (exchange_layout.py, where the planner reads it too): the longest ids payload to
# another rank with which a rank asks for one exchange; a longer one keeps travelling while the
# lookup of the own bags runs, as before
_TAG = 0x1D5  # the point-to-point tag of the ids beyond a pair's room


def room(lengths: deque[int]) -> int:
    """A pair's room for its next payload from its last lengths: the longest, plus a quarter
    of their spread (a steady length pads nothing; a varying one rarely overflows)."""
    if not lengths:
        return 0
    longest = max(lengths)
    return longest + (longest - min(lengths)) // 4


class IdsExchange:
    """One collection's ids exchange and the rooms of its pairs (this rank's ends of them)."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        mesh = parts.mesh
        # False: the separate size exchange on every step (the baseline tests compare with)
        self.enabled = mesh.shard_size == mesh.world_size and mesh.shard_size > 1
        self.width = header_width(len(parts.routing.tables))
        self._sent: list[deque[int]] = [deque(maxlen=HISTORY) for _ in range(mesh.shard_size)]
        self._received: list[deque[int]] = [deque(maxlen=HISTORY) for _ in range(mesh.shard_size)]
        # every rank asked for one exchange in the last headers (the same on every rank)
        self._agreed = False

    @property
    def folds(self) -> bool:
        """Whether this step's sizes ride with its ids: every rank of the group asked for it in
        the last step's headers, which every rank received alike."""
        return self.enabled and self._agreed

    def _ask(self, rows: torch.Tensor, payloads: list[torch.Tensor], refused: bool) -> None:
        """Ask for one exchange on the next step (FOLDS in every header row) where this rank's
        payloads to the others are short enough."""
        me = self.parts.mesh.shard_rank
        longest = max((p.numel() for d, p in enumerate(payloads) if d != me), default=0)
        if self.enabled and longest <= FOLD_MAX and not refused:
            rows[:, 2] |= FOLDS

    def _agree(self, headers: list[list[int]]) -> list[list[int]]:
        """Whether every rank asked for one exchange next; `headers` without that bit."""
        self._agreed = all(h[0] == REFUSED or h[2] & FOLDS for h in headers)
        for h in headers:
            if h[0] != REFUSED:
                h[2] &= ~FOLDS
        return headers

    def exchange(
        self, header: torch.Tensor, payloads: list[torch.Tensor], others: torch.Tensor
    ) -> tuple[list[list[int]], PendingCollective]:
        """Every job rank's size header, and the other ranks' payloads for us joined in rank
        order (arrived where the sizes rode with them). `header`: this rank's, `width` values
        per group rank; `payloads`: per group rank (ours too, kept here); `others`: the other
        ranks' payloads in rank order, one tensor (what the separate exchange sends)."""
        parts, width = self.parts, self.width
        me, group = parts.mesh.shard_rank, range(parts.mesh.shard_size)
        rows = header.view(len(group), width)
        refused = int(rows[0, 0]) == REFUSED
        self._ask(rows, payloads, refused)
        if not self.folds:
            return self._separate(header, payloads, others)
        rooms_to = [room(self._sent[d]) for d in group]
        rooms_from = [room(self._received[s]) for s in group]
        send = [0 if d == me else width + rooms_to[d] for d in group]
        receive = [0 if s == me else width + rooms_from[s] for s in group]
        pieces_to = []  # per other rank: its room's ids, zeros after a shorter payload, header
        for d in group:
            if d != me:
                length = min(payloads[d].numel(), rooms_to[d])
                pieces_to.append(payloads[d][:length])
                if length < rooms_to[d]:
                    pieces_to.append(rows.new_zeros(rooms_to[d] - length))
                pieces_to.append(rows[d])
        wire = torch.cat(pieces_to)  # one copy
        what = f"{BUILDER}: ids all_to_all"
        pending = parts.strategy.all_to_all_async(
            wire, send, receive, name=what, group=parts.mesh.shard
        )
        rest = [  # beyond a pair's room: point-to-point, started now
            parts.strategy.send_async(
                payloads[d][rooms_to[d] :],
                d,
                tag=_TAG,
                name=f"{what} (beyond its room)",
                group=parts.mesh.shard,
            )
            for d in group
            if d != me and payloads[d].numel() > rooms_to[d]
        ]
        received = pending.wait()
        starts = [sum(receive[:s]) for s in group]
        senders = [s for s in group if s != me]
        ends = [start + size for start, size in zip(starts, receive, strict=True)]
        tails = [received[ends[s] - width : ends[s]] for s in senders]
        heads = (tails[0] if len(tails) == 1 else torch.cat(tails)).tolist()  # one host read
        headers = [rows[me].tolist() if s == me else [] for s in group]
        for k, s in enumerate(senders):
            headers[s] = heads[k * width : (k + 1) * width]
        self._agree(headers)
        pieces: list[torch.Tensor] = []
        arriving: list[PendingCollective] = []
        for s in senders:
            length = max(headers[s][1], 0) if headers[s][0] != REFUSED else 0
            kept = min(length, rooms_from[s])
            pieces.append(received[starts[s] : starts[s] + kept])
            if length > kept:
                beyond = torch.empty(length - kept, dtype=torch.int64, device=received.device)
                arriving.append(
                    parts.strategy.receive_async(
                        beyond,
                        s,
                        tag=_TAG,
                        name=f"{what} (beyond its room)",
                        group=parts.mesh.shard,
                    )
                )
                pieces.append(beyond)
        for transfer in [*arriving, *rest]:
            transfer.wait()
        self._record(payloads, headers, refused)
        return headers, _arrived(parts, _joined(pieces, received))

    def _separate(
        self, header: torch.Tensor, payloads: list[torch.Tensor], others: torch.Tensor
    ) -> tuple[list[list[int]], PendingCollective]:
        """The size exchange over the job, then the ids' all_to_all (started, not waited)."""
        parts, me = self.parts, self.parts.mesh.shard_rank
        headers = self._agree(parts.exchange_headers(header, self.width))
        sizes = [headers[g] for g in parts.mesh.group_ranks]
        refused = sizes[me][0] == REFUSED
        if any(h[0] == REFUSED for h in headers):  # no ids travel: every rank stops
            self._record(payloads, sizes, refused)
            return headers, _arrived(parts, header.new_empty(0))
        ids_in = parts.exchange(
            others,
            [0 if d == me else p.numel() for d, p in enumerate(payloads)],
            [0 if s == me else size[1] for s, size in enumerate(sizes)],
            "ids",
        )
        self._record(payloads, sizes, refused)
        return headers, ids_in

    def _record(
        self, payloads: list[torch.Tensor], headers: list[list[int]], refused: bool
    ) -> None:
        """Both ends of each pair note its length (a refused payload's on neither)."""
        me = self.parts.mesh.shard_rank
        for r in range(self.parts.mesh.shard_size):
            if r == me:
                continue
            if not refused:
                self._sent[r].append(payloads[r].numel())
            if headers[r] and headers[r][0] != REFUSED:
                self._received[r].append(headers[r][1])

    def refuse(self) -> None:
        """This rank's batch failed validation: join the step's first exchange with REFUSED
        sizes (and no ids), so the other ranks stop at this step with an error."""
        parts = self.parts
        size = parts.mesh.shard_size
        refused = torch.full((self.width * size,), REFUSED, dtype=torch.int64, device=parts.device)
        if self.enabled:
            empty = refused.new_empty(0)
            self.exchange(refused, [empty] * size, empty)
        else:
            parts.exchange_headers(refused, self.width)


def _joined(pieces: list[torch.Tensor], received: torch.Tensor) -> torch.Tensor:
    """The other ranks' payloads in one tensor: a view where one piece holds them all."""
    if len(pieces) == 1:
        return pieces[0]
    if not pieces:
        return received[:0]
    return torch.cat(pieces)


def _arrived(parts: StepParts, ids: torch.Tensor) -> PendingCollective:
    return PendingCollective(parts.strategy, None, ids, ids, f"{BUILDER}: ids all_to_all")
