"""ManualParallelStrategy: ranks, the process group, the device, collectives and checkpoint IO.

The strategy never wraps, moves or shards a module: the user's module does that in its own
`setup(strategy)` with the builders. It is the only place in manualpar that calls
torch.distributed collectives, so every one of them (the builders' and the embedding exchanges'
too) runs under the same timeout and fails with the same CollectiveError naming the operation and
the rank. Everything here also works with world size 1 and no process group, so the same script
runs as a single process on a laptop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from manualpar.checkpoint.load import load_checkpoint
from manualpar.checkpoint.save import save_checkpoint
from manualpar.environment import ClusterEnvironment, detect_environment
from manualpar.seed import seed_everything
from manualpar.strategy.collectives import Collectives, PendingCollective, ReduceOp
from manualpar.strategy.process_group import (
    adopted_environment,
    destroy_group,
    init_process_group,
    pick_device,
    tear_down_at_exit,
)
from manualpar.strategy.timeouts import DEFAULT_TIMEOUT, TIMEOUT_ENV_VAR, resolve_timeout

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV_VAR",
    "ManualParallelStrategy",
    "PendingCollective",
    "ReduceOp",
]


class ManualParallelStrategy(Collectives):
    """Owns rank information, the process group, the device, collectives and checkpoint IO.

    Args:
        environment: rank information; detected from the launcher's variables if omitted.
        accelerator: "auto" (CUDA if present), "cpu" or "cuda".
        backend: process-group backend; by default gloo on CPU and "cpu:gloo,cuda:nccl" on CUDA
            (so CPU tensors such as metrics can still be reduced).
        timeout: collective timeout (seconds or timedelta); default $MANUALPAR_TIMEOUT_S or 5 min.
        process_group: adopt a group the caller already made instead of creating one.
        check_collectives: before reduce/broadcast, compare shapes and dtypes across ranks
            (one extra tiny collective) so a mismatch raises instead of corrupting or hanging.
    """

    def __init__(
        self,
        environment: ClusterEnvironment | None = None,
        *,
        accelerator: str = "auto",
        backend: str | None = None,
        timeout: float | timedelta | None = None,
        process_group: dist.ProcessGroup | None = None,
        check_collectives: bool = False,
    ) -> None:
        self.timeout = resolve_timeout(timeout)
        self.check_collectives = check_collectives
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        detected = environment or detect_environment()
        self.device = pick_device(accelerator, detected.local_rank)  # this process's own GPU
        self.environment = adopted_environment(detected, process_group)
        self.backend = backend or ("cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo")
        self._owns_group = False
        self._torn_down = False
        self.failed_collective: str | None = None  # the first collective that failed here
        self.group: dist.ProcessGroup | None = process_group
        if self.group is None and self.world_size > 1:
            self.group = init_process_group(self.environment, self.backend, self.timeout)
            self._owns_group = True
            tear_down_at_exit(self)  # a script that ends without teardown() still exits cleanly

    # ---- rank information -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.environment.rank

    @property
    def world_size(self) -> int:
        return self.environment.world_size

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank

    @property
    def node_rank(self) -> int:
        return self.environment.node_rank

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return (
            f"ManualParallelStrategy(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={self.device}, backend={self.backend!r}, "
            f"timeout={self.timeout.total_seconds():g}s, source={self.environment.source!r})"
        )

    def seed_everything(self, seed: int, per_rank: bool = False) -> int:
        """Seed python, numpy and torch; with per_rank, rank r uses seed + r (e.g. dropout)."""
        return seed_everything((seed + self.rank) % 2**32 if per_rank else seed)

    # ---- process group ----------------------------------------------------------------------
    def teardown(self, *, wait_for_peers: bool = True) -> None:
        """Destroy the process group if this strategy created it. Safe to call twice.

        After a collective failed on this rank, peers are not waited for: the group is broken,
        and a teardown in a `finally:` must not replace that error with its own barrier's.
        """
        wait_for_peers = wait_for_peers and self.failed_collective is None
        if self._owns_group and dist.is_initialized():
            # Let every rank finish its last collective first: destroying the group under a
            # peer still inside one (e.g. a DDP reducer's) can hang it.
            try:
                if wait_for_peers:
                    self.barrier("teardown")
            finally:
                destroy_group(self.group)
        self._owns_group = False
        self.group = None
        self._torn_down = self.world_size > 1

    def __enter__(self) -> ManualParallelStrategy:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.teardown(wait_for_peers=exc_type is None)  # a failing rank must not wait for peers

    # ---- checkpoint IO ----------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: Mapping[str, Any],
        *,
        full: bool = False,
        overwrite: bool = True,
    ) -> Path:
        """Save `state` on all ranks (collective). See manualpar.checkpoint.save_checkpoint."""
        return save_checkpoint(self, path, state, full=full, overwrite=overwrite)

    def load_checkpoint(
        self, path: str | os.PathLike, state: dict[str, Any], *, strict: bool = True
    ) -> dict[str, Any]:
        """Load into `state` on all ranks (collective). See manualpar.checkpoint."""
        return load_checkpoint(self, path, state, strict=strict)
