"""How the cost planner judges a candidate: the predicted times it leaves the job with, ordered
one way while tables are still being placed and another once all are."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manualpar.embeddings.plan import TablePlacement
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.planning.topology import Topology

__all__ = ["Option", "Score", "plan_score"]


@dataclass(frozen=True)
class Score:
    """What a candidate leaves the job with; lower is better under either ordering."""

    bound: float  # the least the slowest rank can end at (see _score)
    slowest: float  # the slowest rank now
    hot: float  # time above 90% of the slowest, summed over ranks
    summed: float  # all ranks' time
    fullest: float  # the fullest rank's memory

    def greedy(self) -> tuple[float, ...]:
        """While placing: the bound, then the slowest rank, then the least work in all."""
        return (self.bound, self.slowest, self.summed, self.fullest)

    def final(self) -> tuple[float, ...]:
        """With every table placed: the slowest rank, then how many ranks are nearly as slow
        (several equally slow ranks must all cool before the maximum falls), then all work."""
        return (self.slowest, self.hot, self.summed, self.fullest)


@dataclass(frozen=True)
class Option:
    placement: TablePlacement
    costs: RankCosts
    score: Score
    dtype: torch.dtype


def plan_score(total: RankCosts, topology: Topology, still_to_place: float) -> Score:
    """The bound is at least today's slowest rank, and at least the mean once the tables still
    to place add their least total time: a table whole on one rank is not refused for an
    imbalance the next tables will even out."""
    seconds = total.seconds(topology)
    slowest, summed = float(seconds.max()), float(seconds.sum())
    bound = max(slowest, (summed + still_to_place) / seconds.numel())
    hot = float((seconds - 0.9 * slowest).clamp(min=0).sum())
    return Score(bound, slowest, hot, summed, float(total.memory.max()))
