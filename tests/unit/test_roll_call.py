"""The roll call that names the ranks lost after a failed collective, on an in-memory store with
threads for ranks (no process): who answers, who does not, and a store that fails or hangs."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from manualpar.strategy.roll_call import RollCall, RollCallAnswerer, describe_ranks, roll_call

KEY = "manualpar/roll_call"
# Waits below are longer than this: a roll call that did not end early or stay bounded fails
# the test by its timeout (no timing assert).
pytestmark = pytest.mark.timeout(30)


def test_describe_ranks_groups_them_by_node() -> None:
    assert describe_ranks([3, 2], local_world_size=2) == "ranks 2, 3 (node 1)"
    assert describe_ranks([1], local_world_size=2) == "rank 1 (node 0)"
    assert describe_ranks([5, 2, 3], local_world_size=2) == "ranks 2, 3 (node 1); rank 5 (node 2)"


def test_the_ranks_whose_answerers_are_gone_are_named() -> None:
    store = dist.HashStore()
    # ranks 0 and 1 live on node 0 (rank 1's main thread is busy: its answerer replies);
    # ranks 2 and 3, node 1, are dead: no answerer
    answerer = RollCallAnswerer(store, 1, KEY, poll_s=0.05)
    try:
        found = roll_call(store, 0, 4, key=KEY, local_world_size=2, wait_s=1.0)
    finally:
        answerer.stop()
    assert found == RollCall(missing=(2, 3), world_size=4, local_world_size=2, waited_s=1.0)
    assert found.describe("127.0.0.1:29500") == (
        "No answer: ranks 2, 3 (node 1) did not answer a roll call within 1s; they may be stopped "
        "(SIGSTOP, a debugger), too overloaded to answer, or gone (killed, exited, or their node "
        "lost)"
    )
    # a second survivor failing later sees the same: the keys stay in the store
    assert roll_call(store, 1, 4, key=KEY, local_world_size=2, wait_s=0.2).missing == (2, 3)


def test_everyone_answering_ends_the_call_at_once() -> None:
    store = dist.HashStore()
    answerers = [RollCallAnswerer(store, rank, KEY, poll_s=0.05) for rank in (1, 2)]
    found = roll_call(store, 0, 3, key=KEY, wait_s=60.0)  # ends when every rank answered
    for answerer in answerers:
        answerer.stop()
    assert found.missing == () and found.store_error is None
    assert found.describe("h:1").startswith(
        "All 3 ranks answered a roll call after the failure, so every process is still running: "
        "a rank probably raised, stalled or was paused (this one too, perhaps), or called a "
        "different collective"
    )


def test_a_rank_that_does_not_answer_may_be_stopped_overloaded_or_gone() -> None:
    """A roll call cannot tell a paused (SIGSTOP) or overloaded rank from a dead one: the
    message says so instead of calling it gone, and a rank that finds everyone answering (the
    paused one, once continued) does not claim it was someone else's stall."""
    silent = RollCall(missing=(1,), world_size=2, local_world_size=2, waited_s=3.0)
    assert silent.describe("127.0.0.1:29500") == (
        "No answer: rank 1 (node 0) did not answer a roll call within 3s; it may be stopped "
        "(SIGSTOP, a debugger), too overloaded to answer, or gone (killed, exited, or its node "
        "lost)"
    )
    everyone = RollCall(missing=(), world_size=2, local_world_size=2, waited_s=3.0)
    assert everyone.describe("127.0.0.1:29500") == (
        "All 2 ranks answered a roll call after the failure, so every process is still running: "
        "a rank probably raised, stalled or was paused (this one too, perhaps), or called a "
        "different collective"
    )


class _BrokenStore(dist.HashStore):
    def set(self, key: str, value: object) -> None:  # type: ignore[override]
        raise RuntimeError("Broken pipe\nException raised from sendBytes (a C++ backtrace)")


class _HangingStore(dist.HashStore):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def set(self, key: str, value: object) -> None:  # type: ignore[override]
        self.release.wait(60)  # an unreachable store host: the call never returns


def test_a_failing_store_is_reported_not_raised() -> None:
    found = roll_call(_BrokenStore(), 0, 2, key=KEY, wait_s=1.0)
    assert found.store_error == "Broken pipe"
    assert found.describe("10.0.0.1:29500") == (
        "A roll call through the job's store at 10.0.0.1:29500 failed too (Broken pipe): the "
        "store's host (node 0) is probably the one lost"
    )


def test_a_hanging_store_cannot_hang_the_failing_rank() -> None:
    store = _HangingStore()
    found = roll_call(store, 0, 2, key=KEY, wait_s=0.5)  # bounded by wait_s + 2 s
    store.release.set()
    assert found.store_error == "no answer in 2.5s"


def test_a_real_store_whose_server_died() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=5), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, timedelta(seconds=5))
    answerer = RollCallAnswerer(client, 1, KEY, poll_s=0.05)
    del server  # the host of the store is lost
    found = roll_call(client, 0, 2, key=KEY, wait_s=1.0)
    answerer.stop()  # its store call failed: it ended by itself
    assert found.store_error is not None and found.missing == ()


def test_answerer_stops_without_a_roll_call() -> None:
    store = dist.HashStore()
    answerer = RollCallAnswerer(store, 0, KEY, poll_s=0.05)
    answerer.stop()
    assert not store.check([f"{KEY}/0"])
