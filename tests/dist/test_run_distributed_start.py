"""run_distributed starts a job robustly on a loaded machine: the ranks start the function
together, however long each takes to load it, and a port taken between free_port() and rank 0's
bind runs the job again on another port."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from manualpar import testing
from manualpar.testing import run_distributed


class _SlowToLoadOnRank1:
    """A job function that rank 1 takes a while to unpickle (as a test module slow to import on
    a loaded machine); it answers whether rank 1 had loaded it when this rank started it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if os.environ["RANK"] == "1":
            time.sleep(1.0)
            (Path(self.directory) / "rank_1_loaded").touch()

    def __call__(self) -> bool:
        return (Path(self.directory) / "rank_1_loaded").exists()


def test_the_ranks_start_the_function_together(tmp_path: Path) -> None:
    assert run_distributed(_SlowToLoadOnRank1(str(tmp_path)), 2, timeout=60) == [True, True]


def _joined() -> int:
    import manualpar as mp

    strategy = mp.ManualParallelStrategy()
    total = int(strategy.all_reduce(1.0, op="sum").item())
    strategy.teardown()
    return total


def test_a_port_taken_before_rank_0_binds_it_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]  # what free_port() said, taken since
        free_port = testing.free_port
        monkeypatch.setattr(testing, "free_port", lambda: ports.pop() if ports else free_port())
        assert run_distributed(_joined, 2, timeout=60) == [2, 2]
        assert ports == []  # the taken port was tried first
