"""The wire stage of the search: which allowed wire dtype each collection's exchanges take.

A collection has one pair of wire dtypes (step/wire.py), so the choice is per collection: with
the placements the search found, each collection takes the allowed wire its predicted step is
fastest with (the slowest rank, then plan_score's other orderings), the earlier (more precise)
on a tie, e.g. a collection whose tables are all replicated exchanges nothing and keeps
float32. One pass over the collections suffices: a narrower wire only lowers bytes, so one
collection's best does not depend on another's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from manualpar.embeddings.exchange_layout import WireDtypes
from manualpar.embeddings.plan import EmbeddingPlan
from manualpar.embeddings.planning.cost_model import collection_costs, placement_costs
from manualpar.embeddings.planning.plan_score import plan_score
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.planning.search import Search

__all__ = ["WireChoice", "choose_wires"]


@dataclass(frozen=True)
class WireChoice:
    """A collection's wire dtypes, and why: the predicted slowest rank with each allowed one
    (plan_notes.wire_note says it)."""

    wire: WireDtypes
    slowest: dict[WireDtypes, float]


def choose_wires(
    search: Search, allowed: Sequence[WireDtypes], collection_of: Mapping[str, str]
) -> dict[str, WireChoice]:
    """Per collection (`collection_of`: table key -> collection; a key left out is in ""), the
    wire of `allowed` (most precise first) that the finished `search`'s plan is fastest with."""
    groups: dict[str, list[str]] = {}
    for key in search.tables:
        groups.setdefault(collection_of.get(key, ""), []).append(key)
    parts = {
        name: [_priced(search, keys, wire) for wire in allowed] for name, keys in groups.items()
    }
    chosen = dict.fromkeys(groups, 0)
    choices = {}
    for name in groups:
        totals = []
        for index in range(len(allowed)):
            total = RankCosts.zeros(search.group.world_size)
            for other in groups:
                total = total + parts[other][index if other == name else chosen[other]]
            totals.append(total)
        scores = [plan_score(total, search.topology, 0.0).final() for total in totals]
        chosen[name] = scores.index(min(scores))  # the first of equals: the more precise
        slowest = {wire: score[0] for wire, score in zip(allowed, scores, strict=True)}
        choices[name] = WireChoice(allowed[chosen[name]], slowest)
    return choices


def _priced(search: Search, keys: list[str], wire: WireDtypes) -> RankCosts:
    """The costs of the tables `keys` (one collection) as placed, their exchanges in `wire`."""
    workload = dataclasses.replace(search.workload, wire=wire)
    configs = [search.tables[key] for key in keys]
    plan = EmbeddingPlan(
        search.group.world_size,
        {c.name: search.placements[k] for k, c in zip(keys, configs, strict=True)},
    )
    total = collection_costs(configs, plan, search.topology, search.replicas, wire)
    for key, config in zip(keys, configs, strict=True):
        dtype = search.dtype.get(key, config.dtype)
        stored = config if dtype == config.dtype else dataclasses.replace(config, dtype=dtype)
        total = total + placement_costs(
            stored,
            search.placements[key],
            search.topology,
            workload,
            search.disk_tier,
            key,
            search.replicas,
        )
    return total
