"""ManualParallelStrategy: ranks, the process group, the device, collectives and checkpoint IO.

The strategy never wraps, moves or shards a module: the user's module does that in its own
`setup(strategy)` with the builders. It is the only place in manualpar that calls
torch.distributed collectives, so every one of them (the builders' and the embedding exchanges'
too) runs under the same timeout and fails with the same CollectiveError naming the operation and
the rank. Everything here also works with world size 1 and no process group, so the same script
runs as a single process on a laptop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from manualpar.checkpoint.background import PendingSave, save_checkpoint_async
from manualpar.checkpoint.load import load_checkpoint
from manualpar.checkpoint.save import save_checkpoint
from manualpar.environment import ClusterEnvironment, detect_environment
from manualpar.errors import ClusterEnvironmentError, CollectiveError, MeshError
from manualpar.heap import bulk_io, tune_malloc
from manualpar.seed import seed_everything, seed_rank
from manualpar.strategy.collectives import PendingCollective, ReduceOp
from manualpar.strategy.mesh import (
    build_mesh,
    check_node_layout,
    check_same_dims,
    mesh_shape,
    rank_grid,
)
from manualpar.strategy.point_to_point import PointToPoint
from manualpar.strategy.process_group import (
    adopted_environment,
    destroy_group,
    destroy_subgroup,
    init_process_group,
    init_single_rank_group,
    new_gloo_group,
    pick_device,
    tear_down_at_exit,
)
from manualpar.strategy.roll_call import RollCallAnswerer, roll_call
from manualpar.strategy.self_launch import check_num_processes, launched, relaunch_under_torchrun
from manualpar.strategy.threads import apply_threads, choose_threads
from manualpar.strategy.timeouts import DEFAULT_TIMEOUT, TIMEOUT_ENV_VAR, resolve_timeout

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV_VAR",
    "ManualParallelStrategy",
    "PendingCollective",
    "ReduceOp",
]

log = logging.getLogger("manualpar.checkpoint")
strategy_log = logging.getLogger("manualpar.strategy")


_ROLL_CALL_KEY = "manualpar/roll_call"  # in the job's store (per attempt under torchrun)


class ManualParallelStrategy(PointToPoint):
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
        num_processes: local workers. A plain `python train.py` (no launcher) with N > 1 is
            re-run under torchrun with N workers (this process is replaced, never returns);
            under a launcher it must equal the launcher's processes per node.
        max_restarts: torchrun's restarts of those self-launched workers (kill and resume).
        num_threads: CPU threads per process; default: OMP_NUM_THREADS if set, else torch's
            default divided among this node's processes (one log line says which).
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
        num_processes: int | None = None,
        max_restarts: int = 0,
        num_threads: int | None = None,
    ) -> None:
        if num_processes is not None:
            check_num_processes(num_processes, max_restarts)
            if num_processes > 1 and environment is None and not launched(os.environ):
                relaunch_under_torchrun(num_processes, max_restarts)
        self.timeout = resolve_timeout(timeout)
        self.check_collectives = check_collectives
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        detected = environment or detect_environment()
        self.device = pick_device(accelerator, detected.local_rank)  # this process's own GPU
        self.environment = adopted_environment(detected, process_group)
        if num_processes is not None:
            self._check_launched_processes(num_processes)
        threads = choose_threads(
            num_threads, self.environment.local_world_size, os.environ, torch.get_num_threads()
        )
        apply_threads(threads)
        self.num_threads = threads.count
        malloc = tune_malloc()  # process-wide, like the threads: large temporaries stay mapped
        if self.environment.rank == 0:
            strategy_log.info(threads.describe(self.environment.local_world_size))
            strategy_log.info(malloc.describe())
        self.backend = backend or ("cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo")
        self._owns_group = False
        self._torn_down = False
        self.failed_collective: str | None = None  # the first collective that failed here
        self.group: dist.ProcessGroup | None = process_group
        self.store: dist.Store | None = None  # the store the ranks met through (if we made it)
        self._answerer: RollCallAnswerer | None = None  # answers roll calls after a failure
        self._meshes: dict[tuple[tuple[str, int], ...], DeviceMesh] = {}
        self._mesh_only_group = False  # a 1-rank default group made for mesh() at world size 1
        self._checkpoint_group: dist.ProcessGroup | None = None  # background saves' own group
        self._pending_save: PendingSave | None = None
        if self.group is None and self.world_size > 1:
            self.group, self.store = init_process_group(
                self.environment, self.backend, self.timeout
            )
            self._answerer = RollCallAnswerer(self.store, self.rank, _ROLL_CALL_KEY)
            self._owns_group = True
            tear_down_at_exit(self)  # a script that ends without teardown() still exits cleanly

    def _check_launched_processes(self, num_processes: int) -> None:
        local = self.environment.local_world_size
        if num_processes != local:
            raise ClusterEnvironmentError(
                f"ManualParallelStrategy(num_processes={num_processes}) but the launcher started "
                f"{local} process(es) on this node (rank {self.rank} of {self.world_size}); drop "
                "num_processes when a launcher starts the workers, or make them agree"
            )

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
    def num_nodes(self) -> int:
        """Nodes in the job, from the launcher's processes per node."""
        return max(self.world_size // max(self.environment.local_world_size, 1), 1)

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    # ---- device meshes ----------------------------------------------------------------------
    def mesh(self, **dims: int) -> DeviceMesh:
        """A torch DeviceMesh over this job's ranks with the named dims, outer to inner.

            mesh = strategy.mesh(replicate=2, shard=2)   # HSDP, 2-D tables: mesh["shard"]
            mesh = strategy.mesh(node=2, local=4)         # the launcher's nodes x processes

        Sizes must multiply to the world size (MeshError otherwise). Ranks fill the mesh
        row-major, so with node-major ranks (torchrun, SLURM) the inner dims stay in a node.
        `node` and `local` are checked against the launcher's layout. A collective call on
        every rank the first time: the ranks' dims are compared first (MeshError naming every
        rank's dims if they differ in names, sizes or order), then one process group is made
        per row of each dim, with the strategy's timeout; the same dims return the same mesh
        afterwards. World size 1 works:
        every dim has size 1 (a one-rank group is made if there is none).
        """
        self._check_open("mesh()")
        requested = tuple(dims.items())
        if requested in self._meshes:
            return self._meshes[requested]
        # Agreed first (one small all-gather, under the timeout), so ranks asking for different
        # meshes all raise naming every rank's dims, instead of building different groups.
        check_same_dims(self.all_gather_object(requested))
        names, sizes = mesh_shape(dims, self.world_size)
        key = tuple(zip(names, sizes, strict=True))
        if any(name in ("node", "local") for name in names):
            check_node_layout(names, sizes, self.num_nodes, self.environment.local_world_size)
            self._check_ranks_node_major()
        if self.group is not None and self.group is not dist.group.WORLD:
            raise CollectiveError(
                "mesh(): the strategy adopted a subgroup; build meshes on a strategy over the "
                "whole job (its group must be the default group)"
            )
        if not dist.is_initialized():  # world size 1, no group: a private one-rank group
            init_single_rank_group(self.backend, self.timeout)
            self._mesh_only_group = True
            tear_down_at_exit(self)
        ranks = range(self.world_size)
        with self.collective_guard(f"mesh({', '.join(f'{n}={s}' for n, s in key)})"):
            mesh = build_mesh(self.device.type, names, rank_grid(sizes, ranks), self.timeout)
        self._meshes[key] = mesh
        return mesh

    def _check_ranks_node_major(self) -> None:
        """Every rank must be node_rank * local_world_size + local_rank (agreed, so a launcher
        that numbers ranks otherwise raises on every rank instead of hanging one)."""
        env = self.environment
        expected = env.node_rank * env.local_world_size + env.local_rank
        wrong = self.all_reduce(float(expected != self.rank), op="max")
        if float(wrong) > 0:
            raise MeshError(
                f"mesh(node=..., local=...): the launcher does not number ranks node by node "
                f"(rank {self.rank} is node {env.node_rank}, local rank {env.local_rank} here, "
                "or on another rank); name the dims otherwise and lay them out yourself"
            )

    def _lost_ranks_note(self) -> str | None:
        """After this rank's first failed collective: which ranks are gone, found by a roll
        call through the job's store (a few seconds at most; never raises)."""
        if self.store is None or self.failed_collective is not None:
            return None
        found = roll_call(
            self.store,
            self.rank,
            self.world_size,
            key=_ROLL_CALL_KEY,
            local_world_size=self.environment.local_world_size,
        )
        env = self.environment
        return found.describe(f"{env.master_addr}:{env.master_port}")

    def __repr__(self) -> str:
        return (
            f"ManualParallelStrategy(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={self.device}, backend={self.backend!r}, "
            f"timeout={self.timeout.total_seconds():g}s, source={self.environment.source!r})"
        )

    def seed_everything(self, seed: int, per_rank: bool = False) -> int:
        """Seed python, numpy and torch; with per_rank, rank r uses seed + r (e.g. dropout)."""
        return seed_rank(seed, self.rank) if per_rank else seed_everything(seed)

    # ---- process group ----------------------------------------------------------------------
    def teardown(self, *, wait_for_peers: bool = True) -> None:
        """Destroy the process group if this strategy created it. Safe to call twice. Every
        collective, mesh() and checkpoint save or load raise CollectiveError afterwards, on one
        process as on N (a script must not work alone and fail at scale).

        After a collective failed on this rank, peers are not waited for: the group is broken,
        and a teardown in a `finally:` must not replace that error with its own barrier's.
        """
        save_error = self._finish_pending_save()
        wait_for_peers = wait_for_peers and self.failed_collective is None
        if self._checkpoint_group is not None:
            destroy_subgroup(self._checkpoint_group)
            self._checkpoint_group = None
        if self._answerer is not None:  # before exit: a thread in a store call would abort it
            self._answerer.stop()
            self._answerer = None
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
        self._meshes.clear()
        if self._mesh_only_group and dist.is_initialized():
            destroy_group(dist.group.WORLD)
        self._mesh_only_group = False
        self._torn_down = True  # collectives refuse from now on, at any world size
        if save_error is not None and wait_for_peers:
            raise save_error

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
        self._check_open("save_checkpoint")  # after teardown each rank would write alone
        self.wait_for_checkpoint()
        with bulk_io():  # its chunk copies do not stay on the step's heap (heap.py)
            return save_checkpoint(self, path, state, full=full, overwrite=overwrite)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        *,
        strict: bool = True,
        saturate: bool = False,
        verify: str = "crc",
    ) -> dict[str, Any]:
        """Load into `state` on all ranks (collective). See manualpar.checkpoint.load_checkpoint:
        values beyond a narrower dtype's range are refused unless `saturate=True` clamps them;
        `verify="sizes"` skips the CRC-32 pass over the tensor files (checks their sizes only)."""
        self._check_open("load_checkpoint")  # after teardown each rank would read alone
        self.wait_for_checkpoint()
        with bulk_io():
            return load_checkpoint(
                self, path, state, strict=strict, saturate=saturate, verify=verify
            )

    def save_checkpoint_async(
        self, path: str | os.PathLike, state: Mapping[str, Any], *, overwrite: bool = True
    ) -> PendingSave:
        """Start a sharded save that is written while training goes on (collective); returns
        once `state` is copied to CPU memory. It commits atomically, like `save_checkpoint`,
        when every rank finished writing. A save still in flight is waited for first, and so
        it is by `save_checkpoint`, `load_checkpoint`, `wait_for_checkpoint` and `teardown`.
        See manualpar.checkpoint.background for what it costs."""
        self._check_open("save_checkpoint_async")
        self.wait_for_checkpoint()
        if self._checkpoint_group is None and self.group is not None:
            with self.collective_guard("new_group(checkpoint writes)"):
                self._checkpoint_group = new_gloo_group(self.group, self.timeout)
        self._pending_save = save_checkpoint_async(
            self, path, state, group=self._checkpoint_group, overwrite=overwrite
        )
        return self._pending_save

    def wait_for_checkpoint(self) -> Path | None:
        """Wait for the background save in flight, if any: its path once committed, or its
        CheckpointError/CollectiveError (then nothing was committed); None if there was none."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.wait()

    def _finish_pending_save(self) -> Exception | None:
        """At teardown: let a background save finish (its collectives are bounded by the
        timeout), so the process never exits under a half-written checkpoint it could commit."""
        try:
            self.wait_for_checkpoint()
        except Exception as error:
            log.warning("the checkpoint being saved in the background was not committed: %s", error)
            return error
        return None
