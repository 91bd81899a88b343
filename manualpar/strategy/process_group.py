"""The process group's life: this rank's device, creating or adopting the group, destroying it.

Collectives over the group are the strategy's (strategy.py); this module only makes and unmakes
the group, so the strategy's file holds one idea: what ranks can do together.
"""

from __future__ import annotations

import atexit
import gc
import sys
import traceback
import weakref
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from manualpar.environment import ClusterEnvironment
from manualpar.errors import ClusterEnvironmentError, CollectiveError, ConfigError

__all__ = [
    "adopted_environment",
    "destroy_group",
    "destroy_subgroup",
    "init_process_group",
    "init_single_rank_group",
    "new_gloo_group",
    "pick_device",
    "tear_down_at_exit",
]

# Groups this process destroyed, kept referenced until interpreter exit. A DDP Reducer holds its
# group, and when a model is freed the Reducer's destructor (GIL held) joins gloo's worker
# threads, one of which may still need the GIL to drop a finished collective's tensors: a
# deadlock at exit. While this list holds the group, the last reference dies here instead, in
# the group's own Python binding, whose destructor releases the GIL. _teardown_at_exit lets go
# of them before interpreter finalization.
_RETIRED_GROUPS: list[dist.ProcessGroup] = []
_CLAIMS = "manualpar/rank_claims"  # in a job's own store: one counter per rank number


class _Owner(Protocol):
    def teardown(self, *, wait_for_peers: bool = True) -> None: ...


# Strategies whose group is up and the groups init_process_group made, for _teardown_at_exit.
_OWNERS: weakref.WeakSet[_Owner] = weakref.WeakSet()
_CREATED_GROUPS: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
_at_exit_registered = False


def tear_down_at_exit(owner: _Owner) -> None:
    """Call `owner.teardown(wait_for_peers=False)` at interpreter exit if the script did not."""
    global _at_exit_registered
    _OWNERS.add(owner)
    if not _at_exit_registered:  # at the first group: it runs before earlier imports' handlers
        atexit.register(_teardown_at_exit)
        _at_exit_registered = True


def _teardown_at_exit() -> None:
    """Destroy the groups the script left up, and free every group while threads may still run.

    gloo's worker threads may drop a finished collective's last reference after the waiting rank
    moved on, and that needs the GIL (the work holds Python objects). Once the interpreter is
    finalizing, a thread that asks for the GIL is ended by pthread_exit, whose unwinding through
    a noexcept destructor calls std::terminate: "terminate called without an active exception"
    and SIGABRT after a successful script. Here, before finalization, the last reference to each
    group dies in its Python binding, which releases the GIL while gloo joins its workers.
    No barrier: a peer may be gone, and exiting closes the connections anyway.
    """
    for owner in list(_OWNERS):
        owner.teardown(wait_for_peers=False)  # also drops the strategy's reference to its group
    _OWNERS.clear()
    if dist.is_initialized() and dist.group.WORLD in _CREATED_GROUPS:  # its strategy died first
        destroy_group(dist.group.WORLD)
    _drop_group_holders()
    _RETIRED_GROUPS.clear()


def _drop_group_holders() -> None:
    """Free what still holds a group the script no longer uses: an uncaught exception's frames
    (the model's locals), models in reference cycles, DTensor caches of FSDP meshes."""
    last_traceback = getattr(sys, "last_traceback", None)
    if last_traceback is not None:  # printed already; Python keeps it only for pdb.pm()
        traceback.clear_frames(last_traceback)
    if "torch.distributed.tensor" in sys.modules:
        try:
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()
        except Exception:  # a private torch API: never let it break the exit
            pass
    gc.collect()


def pick_device(accelerator: str, local_rank: int) -> torch.device:
    """One device per local rank: cuda:<local_rank> on GPU nodes, else the CPU."""
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cpu":
        return torch.device("cpu")
    if accelerator != "cuda":
        raise ConfigError(f"accelerator must be 'auto', 'cpu' or 'cuda', got {accelerator!r}")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ClusterEnvironmentError(
            f"local rank {local_rank} needs cuda:{local_rank}, but this node shows {count} "
            "CUDA device(s); launch at most one process per GPU or set CUDA_VISIBLE_DEVICES"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def adopted_environment(
    detected: ClusterEnvironment, group: dist.ProcessGroup | None
) -> ClusterEnvironment:
    """Ranks as seen inside an adopted group (a subgroup numbers its members from 0)."""
    if group is None:
        return detected
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ClusterEnvironmentError(
            "this process is not a member of the adopted process group; "
            "create the strategy only on the group's members"
        )
    is_world = group is dist.group.WORLD
    if (
        is_world
        and detected.source != "single"
        and (detected.rank, detected.world_size) != (rank, world)
    ):
        raise ClusterEnvironmentError(
            f"the adopted process group has rank {rank} of {world}, but the {detected.source} "
            f"environment says rank {detected.rank} of {detected.world_size}; pass a matching "
            "ClusterEnvironment or the world group"
        )
    local_world = min(detected.local_world_size, world) if detected.source != "single" else 1
    return ClusterEnvironment(
        rank=rank,
        world_size=world,
        local_rank=min(detected.local_rank, local_world - 1),
        local_world_size=local_world,
        node_rank=detected.node_rank,
        master_addr=detected.master_addr or "adopted",
        master_port=detected.master_port or 1,
        restart_count=detected.restart_count,
        source="adopted",
    )


def init_process_group(
    env: ClusterEnvironment, backend: str, timeout: timedelta
) -> tuple[dist.ProcessGroup, dist.Store]:
    """Join the default group with a finite timeout; CollectiveError says what to check.

    Returns the group and the store the ranks met through: it outlives a broken group, so after
    a failure the ranks can still find out through it which of them are gone (roll_call.py)."""
    try:
        # Under torchrun the agent already serves the store: join it. Its keys survive a
        # restart, so each attempt gets its own prefix (plain env:// init reuses the dead
        # attempt's gloo addresses and times out after a restart).
        if env.master_addr is None or env.master_port is None:
            raise ClusterEnvironmentError("no master address and port in the environment")
        store: dist.Store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0 and not env.uses_agent_store,
            timeout=timeout,
        )
        if env.uses_agent_store:
            store = dist.PrefixStore(f"manualpar/attempt_{env.restart_count}", store)
        else:
            claim_rank(store, env)
        dist.init_process_group(
            backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    except CollectiveError:
        raise
    except Exception as error:
        busy = "EADDRINUSE" in str(error) or "address already in use" in str(error).lower()
        hint = (
            f"Another process (perhaps another job) already listens on {env.master_addr}:"
            f"{env.master_port}; pick another MASTER_PORT for this job."
            if busy
            else "Check that every rank was started and that the master address and port are "
            "reachable."
        )
        raise CollectiveError(
            f"rank {env.rank} of {env.world_size} could not join the process group at "
            f"{env.master_addr}:{env.master_port} (backend {backend}) within "
            f"{timeout.total_seconds():g}s: {error}. {hint}"
        ) from error
    group = dist.group.WORLD
    assert group is not None  # set by init_process_group
    _CREATED_GROUPS.add(group)
    return group, store


def claim_rank(store: dist.Store, env: ClusterEnvironment) -> None:
    """Claim this rank's number in the store before joining the group: a second claim means
    another process already joined as this rank, usually a rank of another job started on the
    same MASTER_ADDR:MASTER_PORT. It would otherwise join that job's group and wait in a
    collective until the timeout, blaming a peer. (Under torchrun the agent's rendezvous gives
    every rank its number, and its store outlives a strategy, so this runs only on a store the
    ranks met through themselves.)"""
    if store.add(f"{_CLAIMS}/{env.rank}", 1) > 1:
        raise CollectiveError(
            f"rank {env.rank} of {env.world_size}: another process already joined the job at "
            f"{env.master_addr}:{env.master_port} as rank {env.rank}: another job is probably "
            "using the same MASTER_ADDR:MASTER_PORT (pick another MASTER_PORT for this job), "
            f"or two processes of this job were started with rank {env.rank}"
        )


def init_single_rank_group(backend: str, timeout: timedelta) -> None:
    """A default group of this process alone (an in-memory store, no network), so that
    torch's DeviceMesh, DTensor and FSDP APIs also run in a single-process job."""
    dist.init_process_group(
        backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
    )
    group = dist.group.WORLD
    assert group is not None
    _CREATED_GROUPS.add(group)


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Destroy the default group, keeping the Python object alive until exit (see above)."""
    if group is not None:
        _RETIRED_GROUPS.append(group)
    if dist.is_initialized():
        dist.destroy_process_group()


def new_gloo_group(group: dist.ProcessGroup, timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group over the members of `group`, for collectives run from a background thread
    (checkpoint writes): a group of their own never interleaves them with the main thread's.
    Only the members call this (local synchronization), so it also works for an adopted subgroup.
    """
    ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    made = dist.new_group(ranks, timeout=timeout, backend="gloo", use_local_synchronization=True)
    assert made is not None  # this rank is a member
    return made


def destroy_subgroup(group: dist.ProcessGroup) -> None:
    """Destroy a group other than the default one (kept referenced until exit, see above)."""
    _RETIRED_GROUPS.append(group)
    if dist.is_initialized():
        dist.destroy_process_group(group)
