"""The strategy's thread rule: num_threads, else OMP_NUM_THREADS, else torch's default divided
among the node's processes; one log line says which; bad values are refused by name."""

from __future__ import annotations

import pytest
import torch

import manualpar as mp
from manualpar.errors import ClusterEnvironmentError
from manualpar.strategy.threads import choose_threads


def test_the_rule_in_order() -> None:
    assert choose_threads(3, 4, {"OMP_NUM_THREADS": "1"}, 8).count == 3
    assert choose_threads(None, 4, {"OMP_NUM_THREADS": "2"}, 8).count == 2
    assert choose_threads(None, 1, {}, 8).count == 8
    divided = choose_threads(None, 4, {}, 8)
    assert (divided.count, divided.reason) == (2, "torch's 8 divided among 4 processes")
    assert choose_threads(None, 16, {}, 8).count == 1  # never 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_num_threads_is_refused(bad: object) -> None:
    with pytest.raises(ClusterEnvironmentError, match=rf"num_threads={bad!r}\): pass a whole"):
        choose_threads(bad, 1, {}, 2)  # type: ignore[arg-type]


def test_a_bad_environment_variable_is_refused() -> None:
    with pytest.raises(ClusterEnvironmentError, match="OMP_NUM_THREADS='two' is not a thread"):
        choose_threads(None, 1, {"OMP_NUM_THREADS": "two"}, 2)


def test_the_strategy_sets_and_logs_its_threads(caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        with caplog.at_level("INFO", logger="manualpar.strategy"):
            strategy = mp.ManualParallelStrategy(num_threads=1)
        assert torch.get_num_threads() == 1
        assert strategy.num_threads == 1
        assert (
            "CPU threads: 1 per process, 1 process(es) on this node (num_threads); change with "
            "ManualParallelStrategy(num_threads=...) or OMP_NUM_THREADS"
        ) in caplog.text
    finally:
        torch.set_num_threads(before)
