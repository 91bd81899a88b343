"""What the planner asks of a storage tier that keeps rows off memory behind a per-rank cache:
how many cache slots each block gets and how much memory the cache takes. The planner prices
disk tables through this interface only (it never asks which tier it has); `DiskTier`
(storage/disk_settings.py, re-exported by disk_tier.py) implements it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["CachedTier"]


class CachedTier(Protocol):
    """A tier's cache on one rank, for the blocks {table: (block rows, bytes per row)} it
    holds there (weights and optimizer state)."""

    def slots(self, blocks: Mapping[str, tuple[int, int]]) -> dict[str, int]:
        """Cache slots per table (at most its block's rows)."""
        ...

    def cache_memory(self, blocks: Mapping[str, tuple[int, int]]) -> int:
        """Bytes the cache takes on the rank (0 without blocks): its slots' rows and every
        structure it keeps beside them (a disk block's index of where each row is, say), so a
        plan within the budget stays within it in resident memory."""
        ...
