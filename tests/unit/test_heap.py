"""glibc's mmap and trim thresholds: fixed once per process by the strategy, except where the
user set them (glibc's variables) or turned the tuning off; nothing off glibc."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import manualpar as mp
import manualpar.heap as heap
from manualpar.heap import ENV_SWITCH, tune_malloc

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


# A fresh interpreter (heap.py alone, without torch: 0.1 s) tunes, then allocates 16 MiB blocks
# through glibc: whether one is a mapped block, and the minor faults of 10 write-and-free rounds.
PROBE = """
import ctypes, importlib.util, json, resource, sys
spec = importlib.util.spec_from_file_location("heap", sys.argv[1])
heap = sys.modules["heap"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heap)
heap.tune_malloc()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
class Info(ctypes.Structure):
    _fields_ = [(f"f{i}", ctypes.c_size_t) for i in range(10)]  # f3: hblks, mapped blocks
libc.mallinfo2.restype = Info
size = 16 * 2**20
before = libc.mallinfo2().f3
block = libc.malloc(size)
mapped = libc.mallinfo2().f3 - before
libc.free(ctypes.c_void_p(block))
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(ctypes.c_void_p(block))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
print(json.dumps({"mapped": mapped, "faults": faults}))
"""
PAGES = 16 * 2**20 // os.sysconf("SC_PAGE_SIZE")  # one 16 MiB block's pages


def probe(**env: str) -> dict[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_T"))}
    clean.pop(ENV_SWITCH, None)
    run = subprocess.run(
        [sys.executable, "-S", "-c", PROBE, heap.__file__],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(run.stdout)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
    reason="glibc's malloc only",
)
def test_real_glibc_keeps_large_blocks_on_the_heap() -> None:
    tuned = probe()
    assert tuned["mapped"] == 0  # 16 MiB < 32 MiB: from the heap, not a fresh mapping
    assert tuned["faults"] < 2 * PAGES  # only the first round grows the heap; freed, it stays
    assert probe(**{ENV_SWITCH: "0"})["mapped"] == 1  # glibc's own start: 128 KiB threshold
    users = probe(MALLOC_MMAP_THRESHOLD_="1048576")  # the user's fixed 1 MiB is kept
    assert users["mapped"] == 1
    assert users["faults"] >= 9 * PAGES  # every round maps and faults its block in again
