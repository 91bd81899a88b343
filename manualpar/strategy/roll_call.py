"""Which ranks are gone after a collective failed: a roll call through the job's store.

gloo reports a dead peer as "Connection closed by peer [addr]:port" and a stalled one as a
timeout; neither names the rank, let alone its node. Every rank of a job runs a `RollCallAnswerer`:
a daemon thread that polls the store the job rendezvoused through (it outlives the process group)
once a second and, once a roll call is open, writes this rank's key. A rank whose collective
fails opens the call and waits a few seconds: every process still running answers, even one
whose main thread is stuck in a collective (waiting on a peer that failed first). A rank whose
key never comes is gone (killed, exited, its machine lost) or cannot answer in time: stopped
(SIGSTOP, a debugger) or overloaded. The call cannot tell these apart, so it says all three.

Every wait is bounded: the store is polled with non-blocking calls until a deadline, and the whole
roll call runs in a daemon thread that is abandoned past it, so a store whose host is unreachable
cannot hang the failing rank. A store that fails is reported as such (its host is probably the
lost node).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

__all__ = [
    "ANSWER_POLL_S",
    "ROLL_CALL_S",
    "RollCall",
    "RollCallAnswerer",
    "describe_ranks",
    "roll_call",
]

ROLL_CALL_S = 3.0  # how long a failing rank waits for the others to answer
ANSWER_POLL_S = 1.0  # how often each rank's answerer looks for an open roll call
_POLL_S = 0.02


class RollCallAnswerer:
    """Answers the roll call `key` for `rank` from a daemon thread, whatever the main thread is
    doing. `stop()` ends it (the strategy's teardown does, before interpreter exit: a thread
    still inside a store call then would abort the process)."""

    def __init__(self, store: dist.Store, rank: int, key: str, poll_s: float = ANSWER_POLL_S):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(store, rank, key, poll_s),
            name="manualpar-roll-call-answerer",
            daemon=True,
        )
        self._thread.start()
        _stop_at_exit(self)

    def _run(self, store: dist.Store, rank: int, key: str, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                if store.check([f"{key}/open"]):
                    store.set(f"{key}/{rank}", "here")
                    return
            except Exception:  # the store is gone: nobody can call the roll any more
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


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
                f"All {self.world_size} ranks answered a roll call after the failure, so every "
                "process is still running: a rank probably raised, stalled or was paused (this "
                "one too, perhaps), or called a different collective"
            )
        silent = describe_ranks(self.missing, self.local_world_size)
        one = len(self.missing) == 1
        return (
            f"No answer: {silent} did not answer a roll call within {self.waited_s:g}s; "
            f"{'it' if one else 'they'} may be stopped (SIGSTOP, a debugger), too overloaded "
            f"to answer, or gone (killed, exited, or {'its' if one else 'their'} node lost)"
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


_ANSWERERS: weakref.WeakSet[RollCallAnswerer] = weakref.WeakSet()
_exit_hook = False


def _stop_at_exit(answerer: RollCallAnswerer) -> None:
    """Stop answerers that no teardown stopped, before the interpreter finalizes."""
    global _exit_hook
    if not _exit_hook:
        atexit.register(_stop_all)
        _exit_hook = True
    _ANSWERERS.add(answerer)


def _stop_all() -> None:
    for answerer in list(_ANSWERERS):
        answerer.stop()


def roll_call(
    store: dist.Store,
    rank: int,
    world_size: int,
    *,
    key: str,
    local_world_size: int = 1,
    wait_s: float = ROLL_CALL_S,
) -> RollCall:
    """Open the roll call `key`, answer it as `rank`, and wait at most about `wait_s` seconds
    for the other ranks of `world_size` (their answerers) to answer. Never raises or hangs."""
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
    store.set(f"{key}/open", "1")
    everyone = [f"{key}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + wait_s
    while not store.check(everyone):  # one request for all the keys
        if time.monotonic() > deadline:
            missing = tuple(r for r in range(world_size) if not store.check([everyone[r]]))
            return RollCall(missing, world_size, local_world_size, wait_s)
        time.sleep(_POLL_S)
    return RollCall((), world_size, local_world_size, wait_s)


def _short(error: BaseException) -> str:
    """The first line of a store error (torch's carry a C++ backtrace after it)."""
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
