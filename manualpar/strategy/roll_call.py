"""Which ranks are gone after a collective failed: a roll call through the job's store.

gloo reports a dead peer as "Connection closed by peer [addr]:port" and a stalled one as a
timeout; neither names the rank, let alone its node. After a failure each rank that sees it
writes its own key under one prefix in the store the job rendezvoused through (it outlives the
process group) and waits a few seconds for the others' keys. The ranks whose keys never came are
the lost ones: killed, exited, or still stuck in the collective.

Every wait is bounded: the store is polled with non-blocking calls until a deadline, and the whole
roll call runs in a daemon thread that is abandoned after the deadline, so a store whose host is
unreachable cannot hang the failing rank. A store that fails is reported as such (its host is
probably the lost node).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["ROLL_CALL_S", "RollCall", "describe_ranks", "roll_call"]

ROLL_CALL_S = 5.0  # how long a failing rank waits for the others to answer
_POLL_S = 0.05


@dataclass(frozen=True)
class RollCall:
    """What a roll call found: the ranks that did not answer, or why the store could not say."""

    missing: tuple[int, ...]
    world_size: int
    local_world_size: int
    waited_s: float
    store_error: str | None = None

    def describe(self, store_host: str) -> str:
        """One sentence for an error message."""
        if self.store_error is not None:
            return (
                f"A roll call through the job's store at {store_host} failed too "
                f"({self.store_error}): the store's host (node 0) is probably the one lost"
            )
        if not self.missing:
            return (
                f"All {self.world_size} ranks answered a roll call after the failure, so none "
                "was lost: a rank probably raised, stalled, or called a different collective"
            )
        lost = describe_ranks(self.missing, self.local_world_size)
        return (
            f"Lost: {lost} did not answer a roll call within {self.waited_s:g}s "
            "(killed, exited, or stuck)"
        )


def describe_ranks(ranks: Sequence[int], local_world_size: int) -> str:
    """'ranks 2, 3 (node 1)', 'rank 1 (node 0)', 'ranks 2, 3 (node 1); rank 5 (node 2)'.

    Nodes assume node-major numbering (node = rank // processes per node), as torchrun and
    SLURM number ranks."""
    by_node: dict[int, list[int]] = {}
    for rank in sorted(ranks):
        by_node.setdefault(rank // max(local_world_size, 1), []).append(rank)
    parts = []
    for node, members in by_node.items():
        noun = "ranks" if len(members) > 1 else "rank"
        parts.append(f"{noun} {', '.join(map(str, members))} (node {node})")
    return "; ".join(parts)


def roll_call(
    store: dist.Store,
    rank: int,
    world_size: int,
    *,
    key: str,
    local_world_size: int = 1,
    wait_s: float = ROLL_CALL_S,
) -> RollCall:
    """Answer the roll call `key` as `rank` and wait at most about `wait_s` seconds for the
    other ranks of `world_size` to answer it too. Never raises and never hangs."""
    found: list[RollCall] = []

    def call() -> None:
        try:
            found.append(_call(store, rank, world_size, key, local_world_size, wait_s))
        except Exception as error:  # a store that is gone: say so, do not raise over the cause
            found.append(RollCall((), world_size, local_world_size, wait_s, _short(error)))

    thread = threading.Thread(target=call, name="manualpar-roll-call", daemon=True)
    thread.start()
    thread.join(wait_s + 2.0)  # a store call stuck on an unreachable host is left behind
    if found:
        return found[0]
    return RollCall((), world_size, local_world_size, wait_s, f"no answer in {wait_s + 2.0:g}s")


def _call(
    store: dist.Store, rank: int, world_size: int, key: str, local_world_size: int, wait_s: float
) -> RollCall:
    store.set(f"{key}/{rank}", "here")
    answered = store.add(f"{key}/count", 1)  # one counter to poll instead of a key per rank
    deadline = time.monotonic() + wait_s
    while answered < world_size and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        answered = store.add(f"{key}/count", 0)
    missing: tuple[int, ...] = ()
    if answered < world_size:
        missing = tuple(r for r in range(world_size) if not store.check([f"{key}/{r}"]))
    return RollCall(missing, world_size, local_world_size, wait_s)


def _short(error: BaseException) -> str:
    """The first line of a store error (torch's carry a C++ backtrace after it)."""
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
