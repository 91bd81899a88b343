"""The pooled rows of a table-by-table lookup: this rank's own bags summed into its output, and
the other ranks' bags summed and sent back to them.

Kept apart from forward.py (which orders the phases and their exchanges) because it is one
computation, the pooling of each sender's bags in this rank's shards, whose two halves differ
only in where the sums go: straight into the output (ours, while the others' ids travel) or
onto the wire (theirs, with the check of which tables overflowed the wire dtype). The table
batch (batched_tables.py) does the same for every table in one call per sender group.
"""

from __future__ import annotations

import torch

from manualpar.embeddings.kernels.bags import pooled_sum
from manualpar.embeddings.step.bag_expansion import FeatureBags
from manualpar.embeddings.step.exchange import SenderBags, pack_pooled
from manualpar.embeddings.step.parts import StepParts
from manualpar.embeddings.step.results import RoutedIds
from manualpar.embeddings.step.wire import Arriving, start_on_wire

__all__ = ["add_own_pooled", "beyond_wire", "send_pooled"]


def add_own_pooled(
    parts: StepParts, own: list[SenderBags], out: torch.Tensor, bags: FeatureBags, fills: bool
) -> None:
    """Look up this rank's own bags in its own shards, straight into the output (each
    feature's rows expanded to the batch; `fills`: copied into an unfilled output)."""
    routing = parts.routing
    routes = iter(routing.routes_to[routing.rank])
    for shard, shard_bags in zip(routing.routed_local_shards(), own, strict=True):
        pooled = pooled_sum(parts.weight(shard.table), *shard_bags)
        served = [next(routes) for _ in shard.features]
        blocks = pooled.split([bags.counts[route.feature] for route in served])
        for route, block in zip(served, blocks, strict=True):
            parts.layout.add_block(out, route, bags.expand(route.feature, block), None, fills)


def send_pooled(
    parts: StepParts,
    senders: list[list[SenderBags]],
    out: torch.Tensor,
    routed: RoutedIds,
    wire: torch.dtype,
) -> Arriving:
    """Look up the other ranks' bags and send them their pooled rows in `wire` (in flight on
    return; `out`, this rank's output, gives the dtype and device; `routed`, our bags the other
    owners send back)."""
    routing = parts.routing
    local = routing.routed_local_shards()
    pooled = [
        None
        if s == routing.rank
        else [
            pooled_sum(parts.weight(shard.table), *bags)
            for shard, bags in zip(local, senders[s], strict=True)
        ]
        for s in range(routing.world_size)
    ]
    flat, splits = pack_pooled(pooled, like=out)
    receive = parts.layout.output_splits(routed.bags.counts, routed.kept)
    return start_on_wire(
        parts,
        flat,
        splits,
        receive,
        "pooled output",
        wire,
        lambda: beyond_wire(parts, pooled, wire),
    )


def beyond_wire(
    parts: StepParts, pooled: list[list[torch.Tensor] | None], wire: torch.dtype
) -> list[str]:
    """The tables whose pooled rows sent to other ranks exceed the wire dtype's range (the
    slow path of an overflow, for its error)."""
    bound = torch.finfo(wire).max
    local = parts.routing.routed_local_shards()
    return sorted(
        {
            parts.name(shard.table)
            for shards in pooled
            for shard, rows in zip(local, shards or [], strict=False)
            if bool((rows.abs() > bound).any())
        }
    )
