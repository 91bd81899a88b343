"""Seeding and RNG state capture, so a resumed run draws the same random numbers."""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from manualpar.errors import ConfigError

__all__ = [
    "RNGState",
    "Seeding",
    "capture_rng_state",
    "current_seeding",
    "restore_rng_state",
    "seed_everything",
    "seed_rank",
    "warn_if_seeded_per_rank",
]


@dataclass(frozen=True)
class Seeding:
    """How this process was last seeded through seed_everything: the seed passed, whether
    each rank added its rank to it (strategy.seed_everything(..., per_rank=True)), and the
    seed torch got here."""

    seed: int
    per_rank: bool
    applied: int

    def describe(self) -> str:
        return f"seed_everything({self.seed}{', per_rank=True' if self.per_rank else ''})"


_last_seeding: Seeding | None = None


def seed_everything(seed: int) -> int:
    """Seed python's random, numpy and torch (all devices). Returns the seed."""
    return _seed(Seeding(seed, False, seed))


def seed_rank(seed: int, rank: int) -> int:
    """Seed rank `rank` with seed + rank (strategy.seed_everything(seed, per_rank=True)),
    remembered as per-rank seeding (current_seeding). Returns the seed applied."""
    return _seed(Seeding(seed, True, (seed + rank) % 2**32))


def _seed(seeding: Seeding) -> int:
    seed = seeding.applied
    if not 0 <= seed < 2**32:
        raise ConfigError(f"seed must be in [0, 2**32), got {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    global _last_seeding
    _last_seeding = seeding
    return seed


def current_seeding() -> Seeding | None:
    """The last seed_everything, or None if there was none or torch was seeded since by other
    means (torch.manual_seed, a restored RNG state of another seed)."""
    seeding = _last_seeding
    if seeding is None or torch.initial_seed() != seeding.applied:
        return None
    return seeding


def warn_if_seeded_per_rank(who: str, stacklevel: int = 2) -> None:
    """Warn if the RNG is seeded per rank while `who` draws initial values that should be the
    same for any world size: each rank would draw its own full tensor and keep its own slice of
    it, so the values would depend on the world size (and differ from a one-process run's on
    every rank but rank 0). Said at world size 1 too, where it changes nothing yet, so the
    script is fixed before it runs on more ranks. `stacklevel`: `who`'s frame above this call."""
    seeding = current_seeding()
    if seeding is None or not seeding.per_rank:
        return
    warnings.warn(
        f"{who}: torch's RNG is seeded per rank ({seeding.describe()}: this rank drew from "
        f"seed {seeding.applied}), so each rank initializes its slice of the parameters from "
        "another stream and the values depend on the world size. Seed the same on every rank "
        f"before setup (strategy.seed_everything({seeding.seed})) and per rank after it "
        f"(strategy.seed_everything(..., per_rank=True), e.g. for dropout or data)",
        UserWarning,
        stacklevel=stacklevel + 1,  # `who`'s caller
    )


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
