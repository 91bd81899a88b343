"""Keep a training step's large temporaries on glibc's heap instead of fresh mappings.

glibc's malloc serves blocks above its mmap threshold with a fresh mapping and unmaps it when
the block is freed, so every step page-faults its outputs, gradients and loss buffers back in,
zeroed. glibc raises the threshold to the largest block freed so far (up to 32 MiB), so whether
a process pays depends on its history: one step over 26 tables of 200k x 16 took 800-4,100
minor faults and 12.9 ms of thread time, and 6.8 ms with none (docs/benchmarks.md, "Many small
tables"). Fixing the threshold at glibc's own 32 MiB ceiling, and the trim threshold above it so
that freed blocks are not handed straight back to the kernel, removes the faults in every
process alike; the cost is that up to 64 MiB of freed heap stays mapped.

Applied once per process, from the strategy; each setting the user made through glibc's own
variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES) is left alone, and
`MANUALPAR_MALLOC_TUNING=0` turns it off. Elsewhere (macOS, Windows, musl) it does nothing.
Every manualpar entry point that runs a model takes a strategy (the Trainer, `load_trained`,
scoring with `Trainer.predict`), so each is tuned. A process that uses the modules without one
(an unsharded EmbeddingBagCollection for inference) calls `tune_malloc()` itself: a module is a
plain nn.Module that may live in another framework's process, whose allocator it does not own.
Unsharded, 26 tables of 200k x 16 at batch 2048 took 7.5-10.6 ms a forward with 106-1,972
faults, and 6.9-7.6 ms with at most 1 after tune_malloc() (0.86x, median of 5 pairs of fresh
processes, thread time); at batch 512, no difference.

Checkpoint IO: a synchronous save and a load run under glibc's low threshold (`bulk_io`), the
step's after. A background save's writer thread does not: mallopt is process-wide and the step
runs meanwhile, so its temporaries would be faulted in again for the whole write. The writer
makes no large heap copies instead (checkpoint/spill.py: a disk table's copied blocks each have
a storage of their own, which DCP writes without cloning).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

__all__ = ["ENV_SWITCH", "MallocTuning", "bulk_io", "malloc_env", "tune_malloc"]

ENV_SWITCH = "MANUALPAR_MALLOC_TUNING"
MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for its own dynamic threshold on 64-bit hosts
TRIM_THRESHOLD = 64 * 2**20  # above it: a freed 32 MiB block does not shrink the heap again
# while checkpoint IO runs: its chunk copies (8 MiB) as fresh mappings, unmapped when freed
BULK_IO_MMAP_THRESHOLD = 2**20
# mallopt's parameter numbers (malloc.h), and the variables through which a user sets each one
_SETTINGS = {
    "M_MMAP_THRESHOLD": (
        -3,
        MMAP_THRESHOLD,
        "MALLOC_MMAP_THRESHOLD_",
        "glibc.malloc.mmap_threshold",
    ),
    "M_TRIM_THRESHOLD": (
        -1,
        TRIM_THRESHOLD,
        "MALLOC_TRIM_THRESHOLD_",
        "glibc.malloc.trim_threshold",
    ),
}

Mallopt = Callable[[int, int], int]


@dataclass(frozen=True)
class MallocTuning:
    """What tune_malloc did in this process: the settings it applied and why not the others."""

    applied: tuple[str, ...]
    skipped: tuple[str, ...]  # "M_TRIM_THRESHOLD (set by MALLOC_TRIM_THRESHOLD_)", ...

    def describe(self) -> str:
        done = ", ".join(self.applied) or "nothing"
        left = f"; left alone: {', '.join(self.skipped)}" if self.skipped else ""
        return f"malloc tuning: applied {done}{left}; turn off with {ENV_SWITCH}=0"


_done: MallocTuning | None = None


def tune_malloc(
    environ: Mapping[str, str] | None = None, mallopt: Mallopt | None = None
) -> MallocTuning:
    """Fix glibc's mmap and trim thresholds once per process (later calls return the first
    result). `environ` is the process's (None) or a stand-in; `mallopt` replaces glibc's
    function (tests); None finds it, or skips off glibc."""
    global _done
    if _done is None:
        given = os.environ if environ is None else environ
        _done = _tune(given, mallopt if mallopt is not None else _glibc_mallopt())
    return _done


def _tune(environ: Mapping[str, str], mallopt: Mallopt | None) -> MallocTuning:
    if environ.get(ENV_SWITCH, "1") == "0":
        return MallocTuning((), (f"all (set by {ENV_SWITCH}=0)",))
    if mallopt is None:
        return MallocTuning((), ("all (not glibc)",))
    applied, skipped = [], []
    for name, (param, value, variable, tunable) in _SETTINGS.items():
        if users := _set_by_user(environ, variable, tunable):
            skipped.append(f"{name} (set by {users})")
        elif mallopt(param, value) == 1:  # mallopt returns 1 on success, 0 on error
            applied.append(f"{name}={value}")
        else:
            skipped.append(f"{name} (mallopt refused {value})")
    return MallocTuning(tuple(applied), tuple(skipped))


@contextlib.contextmanager
def bulk_io(mallopt: Mallopt | None = None) -> Iterator[None]:
    """Checkpoint IO under glibc's low mmap threshold again, the step's after. Its chunk copies
    come and go in an order the heap cannot reuse well: kept on the heap, a disk table's save
    grew the peak RSS by 30-64 MB over training (9 runs) against 28-35 MB as fresh mappings.
    Only where tune_malloc applied the threshold; `mallopt` replaces glibc's (tests)."""
    applied = _done is not None and any(a.startswith("M_MMAP_THRESHOLD") for a in _done.applied)
    function = (mallopt if mallopt is not None else _glibc_mallopt()) if applied else None
    if function is None:
        yield
        return
    function(_SETTINGS["M_MMAP_THRESHOLD"][0], BULK_IO_MMAP_THRESHOLD)
    try:
        yield
    finally:
        function(_SETTINGS["M_MMAP_THRESHOLD"][0], MMAP_THRESHOLD)


def malloc_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """glibc's variables that start another process (a job this one launches, a peer measured
    against it) with the thresholds tune_malloc gives this one: the user's own where set,
    none with the switch off. Variables act from the process's first allocation on."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_SWITCH, "1") == "0":
        return {}
    return {
        variable: environ.get(variable, str(value))
        for _, value, variable, tunable in _SETTINGS.values()
        if variable in environ or not _set_by_user(environ, variable, tunable)
    }


def _set_by_user(environ: Mapping[str, str], variable: str, tunable: str) -> str | None:
    """Which of glibc's own settings the user made for this threshold, if any."""
    if variable in environ:
        return variable
    return tunable if f"{tunable}=" in environ.get("GLIBC_TUNABLES", "") else None


def _glibc_mallopt() -> Mallopt | None:
    """glibc's mallopt, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        function = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):  # musl has no CS_GNU_LIBC_VERSION
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    return lambda param, value: int(function(param, value))
