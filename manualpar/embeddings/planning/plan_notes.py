"""The cost planner's words: each table's note (what it adds to the slowest rank, the bytes it
sends, the runner-up and why it lost) and the error when a table fits nowhere."""

from __future__ import annotations

from manualpar.embeddings.plan import format_bytes
from manualpar.embeddings.planning.cost_text import format_seconds
from manualpar.embeddings.planning.plan_score import Option
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.storage.disk_tier import DiskTier
from manualpar.errors import PlanError

__all__ = ["no_room", "table_note"]


def table_note(best: Option, rest: list[Option], before: float, budget: int | None) -> str:
    """What `best` adds to the slowest rank and sends, and why the runner-up lost."""
    sent = float(best.costs.sent.max())
    ours = best.score
    added = format_seconds(ours.slowest - before)
    text = f"slowest rank +{added}, up to {format_bytes(sent)} sent a rank"
    if best.placement.on_disk and not any(not o.placement.on_disk for o in rest):
        text = (
            f"on disk: in memory it would exceed the {format_bytes(budget or 0)} budget per "
            f"rank; rows split over all ranks, cached in memory; {text}"
        )
    if not rest:
        return text + "; the only candidate that fits"
    runner = rest[0]
    theirs = runner.score

    def more(a: float, b: float) -> bool:  # beyond rounding
        return a > b + 1e-9 * max(abs(b), 1e-12)

    if more(theirs.slowest, ours.slowest):
        why = f"slowest rank {format_seconds(theirs.slowest - ours.slowest)} slower"
    elif more(theirs.hot, ours.hot):
        why = "as slow a slowest rank, and more ranks nearly as slow"
    elif more(theirs.summed, ours.summed):
        more_in_all = format_seconds(theirs.summed - ours.summed)
        why = f"as slow a slowest rank, {more_in_all} more over all ranks"
    else:
        why = f"same times, {format_bytes(theirs.fullest - ours.fullest)} more on the fullest rank"
    return f"{text}; runner-up {runner.placement}: {why}"


def no_room(
    name: str,
    size: int,
    total: RankCosts,
    budget: int | None,
    world: int,
    disk_tier: DiskTier | None,
) -> PlanError:
    low, high = float(total.memory.min()), float(total.memory.max())
    held = (
        f"{format_bytes(low)} each"
        if low == high
        else f"{format_bytes(low)} to {format_bytes(high)}"
    )
    share = -(-size // world)
    fix = "" if disk_tier is not None else ", or give a DiskTier (disk_tier=) to keep it on disk"
    return PlanError(
        f"table {name!r} ({format_bytes(size)} with optimizer state) fits no rank: split "
        f"over all {world} ranks it needs {format_bytes(share)} each, but ranks already hold "
        f"{held} of a {format_bytes(budget or 0)} budget. Raise the memory budget, add ranks, "
        f"or shrink the tables{fix}"
    )
