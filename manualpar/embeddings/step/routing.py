"""The step's routing: a plan's routes (manualpar/embeddings/routes.py, shared with the planner).
Where the raw ids of owner-remapped tables go is ids/remap.py's RawIdRoutes."""

from __future__ import annotations

from manualpar.embeddings.routes import LocalShard, Route, Routing

__all__ = ["LocalShard", "Route", "Routing"]
