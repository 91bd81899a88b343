"""Tables with tied scores for the ranking tests, and the tie rule written out plainly."""

from __future__ import annotations

import torch


def tied_values(rows: int, dim: int, seed: int = 7) -> torch.Tensor:
    """Small integers (exact float32 dot products) with duplicate rows, so scores tie."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-2, 3, (rows, dim), generator=g).float()
    for copy in range(5, rows, 6):  # every sixth row repeats one of the first rows
        values[copy] = values[copy % 5]
    return values


def int_queries(batch: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (batch, dim), generator=g).float()


def reference_order(queries: torch.Tensor, weight: torch.Tensor) -> list[list[int]]:
    """Each query's items by score (q @ W.T), higher first, then smaller id."""
    scores = (queries @ weight.float().T).tolist()
    return [sorted(range(len(row)), key=lambda j: (-row[j], j)) for row in scores]
