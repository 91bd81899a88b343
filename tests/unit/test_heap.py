"""glibc's mmap and trim thresholds: fixed once per process by the strategy, except where the
user set them (glibc's variables) or turned the tuning off; nothing off glibc."""

from __future__ import annotations

import pytest

import manualpar as mp
import manualpar.heap as heap
from manualpar.heap import ENV_SWITCH, bulk_io, tune_malloc

MMAP, TRIM = -3, -1  # mallopt's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """A process that has not tuned yet, with a recording mallopt in glibc's place."""
    recorder = Recorder()
    monkeypatch.setattr(heap, "_done", None)
    monkeypatch.setattr(heap, "_glibc_mallopt", lambda: recorder)
    return recorder


def test_applied_once_per_process(fresh: Recorder) -> None:
    first = tune_malloc({})
    assert fresh.calls == [(MMAP, 32 * 2**20), (TRIM, 64 * 2**20)]
    assert first.applied == ("M_MMAP_THRESHOLD=33554432", "M_TRIM_THRESHOLD=67108864")
    assert tune_malloc({}) is first
    assert len(fresh.calls) == 2


def test_the_users_settings_are_left_alone(fresh: Recorder) -> None:
    done = tune_malloc({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert fresh.calls == [(MMAP, 32 * 2**20)]
    assert done.skipped == ("M_TRIM_THRESHOLD (set by MALLOC_TRIM_THRESHOLD_)",)


def test_glibc_tunables_count_as_the_users(fresh: Recorder) -> None:
    done = tune_malloc({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"})
    assert fresh.calls == [(TRIM, 64 * 2**20)]
    assert done.skipped == ("M_MMAP_THRESHOLD (set by glibc.malloc.mmap_threshold)",)


def test_the_switch_turns_it_off(fresh: Recorder) -> None:
    done = tune_malloc({ENV_SWITCH: "0"})
    assert fresh.calls == []
    assert f"{ENV_SWITCH}=0" in done.describe()


def test_nothing_happens_off_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_done", None)
    monkeypatch.setattr(heap.sys, "platform", "darwin")
    assert tune_malloc({}).applied == ()


def test_the_strategy_tunes_and_logs_it(fresh: Recorder, caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for name in (ENV_SWITCH, "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level("INFO", logger="manualpar.strategy"):
        strategy = mp.ManualParallelStrategy(num_threads=1)
    strategy.teardown()
    assert fresh.calls == [(MMAP, 32 * 2**20), (TRIM, 64 * 2**20)]
    assert "malloc tuning: applied M_MMAP_THRESHOLD=33554432" in caplog.text


def test_malloc_env_starts_another_process_alike() -> None:
    tuned = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "67108864"}
    assert mp.malloc_env({}) == tuned
    users = {"MALLOC_TRIM_THRESHOLD_": "0"}  # the user's own setting is passed on as it is
    assert mp.malloc_env(users) == {**tuned, **users}
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}  # inherited: not overridden
    assert mp.malloc_env(tunables) == {"MALLOC_MMAP_THRESHOLD_": "33554432"}
    assert mp.malloc_env({ENV_SWITCH: "0"}) == {}


def test_checkpoint_io_runs_under_a_low_mmap_threshold_then_the_steps(fresh: Recorder) -> None:
    tune_malloc({})
    del fresh.calls[:]
    with bulk_io():
        assert fresh.calls == [(MMAP, 2**20)]  # chunk copies as fresh mappings, unmapped freed
    assert fresh.calls == [(MMAP, 2**20), (MMAP, 32 * 2**20)]
    with pytest.raises(KeyError), bulk_io():  # restored when the IO fails too
        raise KeyError("a failed load")
    assert fresh.calls[-1] == (MMAP, 32 * 2**20)


def test_checkpoint_io_leaves_a_threshold_it_did_not_set(fresh: Recorder) -> None:
    tune_malloc({"MALLOC_MMAP_THRESHOLD_": "65536"})
    del fresh.calls[:]
    with bulk_io():
        pass
    assert fresh.calls == []
