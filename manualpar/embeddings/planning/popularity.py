"""How many distinct rows a step touches: uniform ids, or ids with Zipf popularity.

A step's updates, its disk cache misses and a 2-D mesh's gradient sums all scale with the
distinct rows its ids touch, not with the ids: under Zipf(1.05), 40,960 ids from a million rows
touch far fewer rows than uniform ones. The expectation is summed over the popularity ranks
(each rank i drawn with chance p_i: 1 - exp(-draws p_i)), one by one for the most popular, then
in log-spaced bins; a unit test checks it against simulated draws.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["distinct_rows"]

EXACT_TERMS = 512  # Zipf ranks summed one by one; past them, LOG_BINS log-spaced bins
LOG_BINS = 256


@functools.lru_cache(maxsize=256)
def _rank_grid(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points and weights that sum a smooth function of the rank over ranks first..last: every
    rank up to EXACT_TERMS past `first`, then log-spaced bins (midpoint, weighted by width)."""
    exact_end = min(last, first + EXACT_TERMS - 1)
    points = torch.arange(first, exact_end + 1, dtype=torch.float64)
    weights = torch.ones_like(points)
    if exact_end < last:
        edges = torch.logspace(
            torch.log10(torch.tensor(exact_end + 0.5)).item(),
            torch.log10(torch.tensor(last + 0.5)).item(),
            LOG_BINS + 1,
            dtype=torch.float64,
        )
        points = torch.cat([points, (edges[1:] * edges[:-1]).sqrt()])
        weights = torch.cat([weights, edges[1:] - edges[:-1]])
    return points, weights


@functools.lru_cache(maxsize=256)
def _zipf_norm(rows: int, skew: float) -> float:
    points, weights = _rank_grid(1, rows)
    return float((weights * points.pow(-skew)).sum())


def distinct_rows(
    draws: torch.Tensor, rows: int, skew: float = 0.0, beyond: int = 0
) -> torch.Tensor:
    """Expected distinct rows among `draws` ids drawn from a table of `rows` rows, uniformly
    (`skew` 0) or with Zipf(`skew`) popularity, counting only rows past the `beyond` most
    popular (those a cache of `beyond` rows would hold)."""
    draws = torch.as_tensor(draws, dtype=torch.float64)
    if beyond >= rows or rows <= 0:
        return torch.zeros_like(draws)
    if skew == 0:
        return (rows - beyond) * -torch.expm1(-draws / rows)
    norm = _zipf_norm(rows, skew)
    points, weights = _rank_grid(beyond + 1, rows)
    chance = points.pow(-skew) / norm
    return (weights * -torch.expm1(-draws.unsqueeze(-1) * chance)).sum(-1)
