"""Seeding and RNG state capture, so a resumed run draws the same random numbers."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RNGState", "capture_rng_state", "restore_rng_state", "seed_everything"]


def seed_everything(seed: int) -> int:
    """Seed python's random, numpy and torch (all devices). Returns the seed."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


def capture_rng_state() -> dict[str, Any]:
    """All RNG states as tensors and plain values, loadable with torch.load(weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    keys = np.asarray(keys)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of capture_rng_state."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState:
    """A per-rank checkpoint entry: `state["rng"] = RNGState()` saves and restores each rank's RNGs.

    Every rank keeps its own stream; on load each rank gets the stream it saved. Ranks that did not
    exist when the checkpoint was written keep their current state (a warning says so).
    """

    per_rank = True

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state)
