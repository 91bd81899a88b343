"""A plan's predicted costs as text: memory, bytes per link and step time per rank, summarized
past a few ranks (plan_text.per_rank_text) so that a 1,024-rank plan stays a few lines."""

from __future__ import annotations

from collections.abc import Callable

from manualpar.embeddings.plan import format_bytes
from manualpar.embeddings.plan_text import per_rank_text
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.planning.topology import Topology

__all__ = ["costs_text", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """A duration as `1.25 ms` (three significant digits) or, from a second, `1.25 s`."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms"


def costs_text(costs: RankCosts, topology: Topology, batch_per_rank: int, replicas: int = 1) -> str:
    """The predicted per-rank lines of `python -m manualpar plan`. With `replicas`, `costs` are
    one shard group's (plan_costs(..., replicas=)), the same in every group."""

    def line(label: str, values: list[float], fmt: Callable[[float], str] = format_bytes) -> str:
        return f"  {label}: " + per_rank_text(values * replicas, fmt)

    nodes = topology.nodes
    mesh = f" as a {replicas} x {topology.world_size // replicas} mesh" if replicas > 1 else ""
    lines = [
        f"predicted per step on {topology.name} ({topology.world_size} ranks{mesh}, "
        f"{topology.ranks_per_node} a node; {batch_per_rank} samples a rank)",
        line("step time (embeddings)", costs.seconds(topology).tolist(), format_seconds),
        line("memory", costs.memory.tolist()),
    ]
    if float(costs.disk.max()) > 0:
        lines.append(line("on disk", costs.disk.tolist()))
    lines.append(line("sent on the node's links", costs.sent_intra.tolist()))
    if nodes > 1:
        lines.append(line("sent across nodes", costs.sent_inter.tolist()))
    lines.append(line("received", costs.received.tolist()))
    return "\n".join(lines)
