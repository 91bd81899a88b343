"""The backward half of a step's exchange layout: which output-gradient columns go to which
owner, and how an owner reads the gradients of its shards (exchange.py's 4: the reverse of the
pooled output). ExchangeLayout (exchange.py) is this with the forward half."""

from __future__ import annotations

import torch

from manualpar.embeddings.step.bag_expansion import OutputGrad
from manualpar.embeddings.step.column_blocks import Strided, column_view, strided_spans
from manualpar.embeddings.step.routing import LocalShard, Route, Routing

__all__ = ["GradientLayout", "Kept"]

# compact layouts: per owner (None: ourselves), per route, our bags with ids there (None: all)
Kept = list[list[torch.Tensor | None] | None] | None


class GradientLayout:
    """One plan's output-gradient layout, bound to its Routing."""

    def __init__(self, routing: Routing) -> None:
        self.routing = routing
        # per owner: the gradient columns of its routes as one strided block
        # (column_blocks.py), or None; by full_rows, made at first use
        self._grad_strided: dict[bool, list[Strided | None]] = {}
        self._widths: dict[bool, list[int]] = {}  # grad_width of each routed local shard

    def _shard_widths(self, full_rows: bool) -> list[int]:
        """`grad_width` of each routed local shard, in order (fixed: made once)."""
        found = self._widths.get(full_rows)
        if found is None:
            local = self.routing.routed_local_shards()
            found = self._widths[full_rows] = [self.grad_width(s, full_rows) for s in local]
        return found

    def grad_columns(self, route: Route, full_rows: bool) -> tuple[int, int]:
        """The output-gradient columns an owner needs for one route."""
        base = self.routing.feature_offsets[route.feature]
        if full_rows and self.routing.splits_cols(route.table):
            return base, base + self.routing.dims[route.feature]
        start = base + route.shard.col_start
        return start, start + route.cols

    def pack_output_grad(
        self,
        grad: OutputGrad,
        full_rows: bool,
        frozen: frozenset[int] = frozenset(),
        kept: Kept = None,
        trailer: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Sender side: the output-gradient blocks each other owner needs, in its route order, and
        the send splits (0 to ourselves); none for `frozen` tables; the rows of `kept` bags only
        in a compact layout. `trailer` (a few elements, e.g. the non-finite flag): sent after
        each other owner's blocks (counted in its split)."""
        blocks: list[torch.Tensor] = []
        splits = []
        whole = grad.bags is None or not grad.bags.variable  # a plain batch
        strided = self._grad_spans(full_rows) if whole and not frozen else None
        if strided is not None and kept is None:
            packed = self._pack_strided(grad.grad, strided, trailer)
            if packed is not None:
                return packed
        tail = None if trailer is None else trailer.to(grad.grad.dtype)
        copied = 0  # blocks copied out by one strided view (a fresh buffer each)
        for owner, routes in enumerate(self.routing.routes_to):
            if owner == self.routing.rank:
                splits.append(0)
                continue
            start_len = len(blocks)
            owner_kept = None if kept is None else kept[owner]
            spans = None if strided is None or owner_kept is not None else strided[owner]
            if spans is not None:
                view = column_view(grad.grad, spans)  # every route's columns at once
                blocks.append(view.clone(memory_format=torch.contiguous_format).view(-1))
                copied += 1
                if tail is not None:
                    blocks.append(tail)
                splits.append(sum(b.numel() for b in blocks[start_len:]))
                continue
            for r, route in enumerate(routes):
                if route.table in frozen:
                    continue
                start, end = self.grad_columns(route, full_rows)
                columns = grad.columns(route.feature, start, end)
                rows = None if owner_kept is None else owner_kept[r]
                if rows is not None:
                    columns = columns.index_select(0, rows)
                blocks.append(columns.flatten())
            if tail is not None:
                blocks.append(tail)
            splits.append(sum(b.numel() for b in blocks[start_len:]))
        if len(blocks) == 1 and copied == 1:  # a fresh buffer already
            return blocks[0], splits
        flat = torch.cat(blocks) if blocks else grad.grad.new_empty(0)
        return flat, splits

    def _pack_strided(
        self, grad: torch.Tensor, strided: list[Strided | None], trailer: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int]] | None:
        """`pack_output_grad` where every other owner's routes are one strided block: each
        copied straight into its place in one buffer (and the trailer after it); None if some
        owner's are not."""
        rank, extra = self.routing.rank, 0 if trailer is None else trailer.numel()
        sizes = []
        for owner, spans in enumerate(strided):
            if owner == rank:
                sizes.append(0)
            elif spans is None:
                return None
            else:
                sizes.append(spans[0] * grad.shape[0] * spans[3] + extra)
        flat = grad.new_empty(sum(sizes))
        offset = 0
        for owner, (spans, size) in enumerate(zip(strided, sizes, strict=True)):
            if owner == rank or spans is None:
                continue
            view = column_view(grad, spans)  # every route's columns at once
            flat[offset : offset + size - extra].view(view.shape).copy_(view)
            if trailer is not None:
                flat[offset + size - extra : offset + size].copy_(trailer)
            offset += size
        return flat, sizes

    def _grad_spans(self, full_rows: bool) -> list[Strided | None]:
        """Per owner: the output-gradient columns of its routes as one strided block, or
        None (fixed by the plan and the rule: made once)."""
        found = self._grad_strided.get(full_rows)
        if found is None:
            found = self._grad_strided[full_rows] = [
                strided_spans([self.grad_columns(route, full_rows) for route in routes])
                for routes in self.routing.routes_to
            ]
        return found

    def own_grad_blocks(
        self,
        grad: OutputGrad,
        full_rows: bool,
        frozen: frozenset[int] = frozenset(),
    ) -> list[list[torch.Tensor]]:
        """Per local shard: the gradient of our own bags, one (batch, width) block per feature,
        copied out of the output gradient: as a column slice its rows would lie a whole output row
        apart, on few cache sets, and the update reads them in random order. None for `frozen`
        tables."""
        routes = self.routing.routes_to[self.routing.rank]
        blocks: list[list[torch.Tensor]] = []
        index = 0
        for shard in self.routing.routed_local_shards():
            views = []
            for route in routes[index : index + len(shard.features)]:
                if route.table in frozen:
                    continue
                start, end = self.grad_columns(route, full_rows)
                views.append(grad.columns(route.feature, start, end).contiguous())
            index += len(shard.features)
            blocks.append(views)
        return blocks

    def grad_width(self, shard: LocalShard, full_rows: bool) -> int:
        """Columns of the output gradient an owner receives for one of its shards."""
        if full_rows and self.routing.splits_cols(shard.table):
            return self.routing.tables[shard.table].embedding_dim
        return shard.shard.cols

    def grad_receive_splits(
        self,
        bag_counts: list[list[int]],
        full_rows: bool,
        frozen: frozenset[int] = frozenset(),
        trailer: int = 0,
    ) -> list[int]:
        """Owner side: how many gradient floats each other sender sends for our shards;
        `bag_counts[k][sender]`: the bags of our k-th shard that sender's ids filled (each a
        gradient row); `trailer`: pack_output_grad's trailer elements, counted too."""
        local = self.routing.routed_local_shards()
        widths = self._shard_widths(full_rows)
        senders = len(bag_counts[0]) if bag_counts else self.routing.world_size
        if not frozen:
            return [
                0
                if sender == self.routing.rank
                else trailer
                + sum(
                    counts[sender] * width for counts, width in zip(bag_counts, widths, strict=True)
                )
                for sender in range(senders)
            ]
        return [
            0
            if sender == self.routing.rank
            else trailer
            + sum(
                bag_counts[k][sender] * widths[k]
                for k, shard in enumerate(local)
                if shard.table not in frozen
            )
            for sender in range(senders)
        ]

    def grad_blocks(
        self,
        received: torch.Tensor,
        bag_counts: list[list[int]],
        full_rows: bool,
        frozen: frozenset[int] = frozenset(),
        trailer: int = 0,
    ) -> list[list[torch.Tensor | None]]:
        """Owner side: per local shard, per sender rank, a (bags, width) view of the gradient that
        sender sent (None for ourselves, and for `frozen` tables), skipping the `trailer`
        elements after each sender's."""
        local = self.routing.routed_local_shards()
        widths = self._shard_widths(full_rows)
        senders = len(bag_counts[0]) if bag_counts else self.routing.world_size
        per_shard: list[list[torch.Tensor | None]] = [[None] * senders for _ in local]
        offset = 0
        for sender in range(senders):
            if sender == self.routing.rank:
                continue
            for k, (shard, width) in enumerate(zip(local, widths, strict=True)):
                if shard.table in frozen:
                    continue
                rows = bag_counts[k][sender]
                per_shard[k][sender] = received[offset : offset + rows * width].view(rows, width)
                offset += rows * width
            offset += trailer
        return per_shard
