"""The step's routing: a plan's routes (manualpar/embeddings/routes.py, shared with the planner)
and where the raw ids of owner-remapped tables go."""

from __future__ import annotations

from typing import Protocol

import torch

from manualpar.embeddings.routes import LocalShard, Route, Routing

__all__ = ["LocalShard", "RawIdRoutes", "Route", "Routing"]


class RawIdRoutes(Protocol):
    """Tables whose raw ids travel to the row block holding their bucket, remapped there
    (owner_remap.py): where each raw id goes."""

    @property
    def tables(self) -> frozenset[int]:
        """Indices of those tables in the routing."""

    def route_keys(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """A row of each raw id's bucket, which places it in its row block."""
