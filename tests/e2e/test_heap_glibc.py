"""glibc's malloc as tune_malloc leaves it, in a fresh interpreter (heap.py alone, without
torch: 0.1 s): whether a 16 MiB block is a mapped block, and the minor faults of 10
write-and-free rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import manualpar.heap as heap
from manualpar.heap import ENV_SWITCH

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
