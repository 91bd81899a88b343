"""ReadAhead: the same batches as the data function, index by index, read one ahead in a
background thread; errors at their own index with their own traceback; nothing left running."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

import manualpar as mp
from manualpar.loop.read_ahead import ReadAhead


class Recorder:
    """A data function that records who asked for what, and fails where told to."""

    def __init__(self, fail_at: int | None = None, end: int = 100) -> None:
        self.calls: list[tuple[int, str]] = []
        self.fail_at, self.end = fail_at, end
        self.inside = 0
        self.overlapped = False
        self.lock = threading.Lock()

    def __call__(self, index: int, strategy: object) -> list[int]:
        with self.lock:
            self.inside += 1
            self.overlapped |= self.inside > 1
        try:
            time.sleep(0.002)  # room for two calls to overlap, were that possible
            self.calls.append((index, threading.current_thread().name))
            if index == self.fail_at:
                raise_from_the_reader(index)
            if index >= self.end:
                raise StopIteration
            return [index, index * index]
        finally:
            with self.lock:
                self.inside -= 1


def raise_from_the_reader(index: int) -> None:
    raise ValueError(f"bad line in batch {index}")


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("manualpar-read-ahead")]


def test_batches_are_the_data_functions_and_read_one_ahead() -> None:
    data = Recorder()
    strategy = mp.ManualParallelStrategy()
    with ReadAhead(data) as prefetched:
        got = [prefetched(i, strategy) for i in range(5)]
        assert got == [[i, i * i] for i in range(5)]
        time.sleep(0.05)
        indices = [i for i, _ in data.calls]
        assert indices == [0, 1, 2, 3, 4, 5]  # index 5 already read, none beyond
        threads = {name for _, name in data.calls[1:]}
        assert all(name.startswith("manualpar-read-ahead") for name in threads)
    assert not _prefetch_threads()
    assert not data.overlapped


def test_another_index_than_the_one_read_ahead_is_read_as_asked() -> None:
    data = Recorder()
    strategy = mp.ManualParallelStrategy()
    with ReadAhead(data) as prefetched:
        assert prefetched(0, strategy) == [0, 0]
        assert prefetched(7, strategy) == [7, 49]  # a resume: index 1 dropped
        assert prefetched(0, strategy) == [0, 0]  # a restart
        assert prefetched(1, strategy) == [1, 1]
    assert not data.overlapped


def test_an_error_reaches_its_own_index_with_its_traceback() -> None:
    data = Recorder(fail_at=3)
    strategy = mp.ManualParallelStrategy()
    prefetched = ReadAhead(data)
    assert [prefetched(i, strategy) for i in range(3)] == [[0, 0], [1, 1], [2, 4]]
    with pytest.raises(ValueError, match="bad line in batch 3") as raised:
        prefetched(3, strategy)
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "raise_from_the_reader" in frames
    prefetched.close()
    assert not _prefetch_threads()


def test_stop_iteration_ends_at_the_last_batch() -> None:
    data = Recorder(end=2)
    strategy = mp.ManualParallelStrategy()
    with ReadAhead(data) as prefetched:
        assert prefetched(1, strategy) == [1, 1]
        with pytest.raises(StopIteration):
            prefetched(2, strategy)


def test_the_trainer_data_contract_through_step_batches() -> None:
    """The Trainer's fetch (step_batches) sees the same micro-batches and the same end."""
    from manualpar.loop.data import step_batches

    strategy = mp.ManualParallelStrategy()
    with ReadAhead(Recorder(end=5)) as prefetched:
        for step in range(2):
            batches, ran_out = step_batches(strategy, prefetched, step, 2)
            assert batches == [[2 * step + m, (2 * step + m) ** 2] for m in range(2)]
            assert ran_out == {}
        batches, ran_out = step_batches(strategy, prefetched, 2, 2)
        assert batches is None and ran_out == {0: 5}
