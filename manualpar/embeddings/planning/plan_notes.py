"""The explain stage: each table's note once the search is done (what it adds to the slowest
rank, the bytes it sends, the runner-up among its candidates and why it lost, the dtype it
was given), and each collection's wire dtypes (the slowest rank with each allowed)."""

from __future__ import annotations

from manualpar.embeddings.dtype_names import dtype_name
from manualpar.embeddings.exchange_layout import wire_name
from manualpar.embeddings.plan import format_bytes
from manualpar.embeddings.planning.cost_text import format_seconds
from manualpar.embeddings.planning.plan_score import Option, plan_score
from manualpar.embeddings.planning.search import Search
from manualpar.embeddings.planning.wire_choice import WireChoice

__all__ = ["search_notes", "table_note", "wire_note"]


def wire_note(choice: WireChoice) -> str:
    """Why a collection's exchanges travel in `choice.wire`, e.g. "planned from fp32, bf16:
    slowest rank 4.1 ms with fp32, 2.9 ms with bf16"."""
    if len(choice.slowest) == 1:
        return "planned: the only wire dtype allowed"
    names = ", ".join(wire_name(wire) for wire in choice.slowest)
    times = ", ".join(
        f"{format_seconds(seconds)} with {wire_name(wire)}"
        for wire, seconds in choice.slowest.items()
    )
    return f"planned from {names}: slowest rank {times}"


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


def search_notes(search: Search) -> dict[str, str]:
    """Per table: what it adds to the slowest rank, and the runner-up given the others."""
    notes = {key: f"pinned: {placement}" for key, placement in search.pinned.items()}
    for key in search.order:
        costs = search.chosen_costs(key)
        base = search.total - costs
        placement, dtype = search.placements[key], search.dtype[key]
        chosen = Option(placement, costs, plan_score(base + costs, search.topology, 0.0), dtype)
        rest = [
            o
            for o in search.options(key, base, 0.0, final=True)
            if (o.placement, o.dtype) != (placement, dtype)
        ]
        before = float(base.seconds(search.topology).max())
        note = table_note(chosen, rest, before, search.budget)
        if dtype != search.tables[key].dtype:
            note = (
                f"in {dtype_name(dtype)}: in {dtype_name(search.tables[key].dtype)} it would "
                f"exceed the {format_bytes(search.budget or 0)} budget per rank; {note}"
            )
        notes[key] = note
    return {key: notes[key] for key in search.tables}
