"""Where a disk-tier step's time goes: the tier's phases timed inside each step, per rank.

`PhaseClock.install()` wraps the disk tier's phase methods (class-wide, in this benchmark process
only) with timers; `take()` returns the seconds each phase took since the last call, and the
bytes this process read from and wrote to the device (`/proc/self/io`: reads the page cache
served are not counted, so `device_read_mb` is the page cache's misses). Phases nest: `to_slots`
holds `assign` (the cache's bookkeeping), `fetch` (`read_into_slots`, or `read` and
`into_slots` on the torch path; `generate`), `copy_out` and `append`; `append` holds `drain`
(its own time beside it: handing the batch to the writing thread); `write_wait` is the wait for
the batch before, wherever it falls. A drain's parts (`chunk_read`, `chunk_write`, `log_read`,
`record_write`) are timed in whichever thread runs them: with the background drain, mostly its
own thread, beside the step rather than in it (`drain_step` and `drain_finish` are its share of
the step).

`StepCPU` counts the process's CPU a timed step takes (every thread: the drain's and the writes'
too) less the making of the batches, and `summary_of` sets each variant's jobs against the
in-memory ones (bench_disk_tier.py's summary): on a loaded host the wall time counts the waits
for a core, the CPU time does not.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PHASES = {
    # phase: (module, class or None for a function of the module, name)
    "begin_step": ("disk_tier", "DiskTable", "begin_step"),  # holds drain_step
    "to_slots": ("disk_tier", "DiskTable", "to_slots"),
    "assign": ("row_cache", "RowCache", "assign_ids"),  # the cache's bookkeeping, in to_slots
    "release": ("disk_tier", "DiskTable", "release"),
    "fetch": ("disk_tier", "DiskTable", "_fetch"),
    "read": ("background_writes", "BackgroundWrites", "read"),
    # the C++ fetch: records read straight into their slots (instead of `read`, `into_slots`)
    "read_into_slots": ("background_writes", "BackgroundWrites", "fetch"),
    "generate": ("disk_tier", None, "init_rows_into"),
    "into_slots": ("row_file", "RowFile", "to_slots"),
    "copy_out": ("disk_tier", "DiskTable", "_copy_out"),
    "append": ("write_log", "WriteLog", "append"),
    "drain": ("write_log", "WriteLog", "drain"),
    # a drain's parts: the places' chunks read and written whole, the log's records read, the
    # records written one at a time, the kept rows moved, the logged rows found
    "chunk_read": ("row_file", "RowFile", "read_range"),
    "chunk_write": ("row_file", "RowFile", "write_range"),
    "log_read": ("write_log", "WriteLog", "_records"),
    "record_write": ("row_file", "RowFile", "write"),
    "keep": ("write_log", "WriteLog", "_move_to_head"),  # before the background drain
    # the background drain's parts in the step: taking a piece and handing the next one to its
    # thread, and an epoch finished in the step (the log filled first)
    "drain_step": ("background_drain", "BackgroundDrain", "advance"),
    "drain_finish": ("background_drain", "BackgroundDrain", "finish"),
    "find_logged": ("row_cache", "RowCache", "logged_rows"),
    "write_wait": ("background_writes", "BackgroundWrites", "settle"),
}


def _io_bytes() -> tuple[int, int]:
    """(read_bytes, write_bytes) of this process at the device, or zeros where unreadable."""
    try:
        text = Path("/proc/self/io").read_text()
        fields = dict(line.split(": ") for line in text.splitlines() if ": " in line)
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


class PhaseClock:
    """Seconds per phase of the disk tier, summed since the last `take()`: wall time, and the
    CPU time of the thread that ran it (`cpu_` keys: on a loaded host the wall time counts the
    waits for a core, the CPU time does not)."""

    def __init__(self) -> None:
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.cpu: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.io = _io_bytes()
        self.process_cpu = time.process_time()

    def install(self) -> None:
        import importlib

        for phase, (module, cls, method) in PHASES.items():
            try:  # a phase the source tree measured (--baseline-src) lacks stays at zero
                owner = importlib.import_module(f"manualpar.embeddings.storage.{module}")
                owner = owner if cls is None else getattr(owner, cls)
                setattr(owner, method, self._timed(phase, getattr(owner, method)))
            except (ImportError, AttributeError):
                continue

    def _timed(self, phase: str, method: Callable[..., Any]) -> Callable[..., Any]:
        seconds, cpu = self.seconds, self.cpu

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began, began_cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - began
                cpu[phase] += time.thread_time() - began_cpu

        return timed

    def take(self) -> dict[str, float]:
        """Each phase's seconds (wall and CPU), the process's CPU seconds (every thread: the
        drain's too) and the device MB read and written since the last call."""
        out = {phase: self.seconds[phase] for phase in PHASES}
        out.update({f"cpu_{phase}": self.cpu[phase] for phase in PHASES})
        self.seconds.clear()
        self.cpu.clear()
        now = time.process_time()
        out["cpu_process"], self.process_cpu = now - self.process_cpu, now
        read, written = _io_bytes()
        out["device_read_mb"] = (read - self.io[0]) / 1e6
        out["device_write_mb"] = (written - self.io[1]) / 1e6
        self.io = (read, written)
        return out


class StepCPU:
    """The process's CPU seconds per timed step (every thread), less the main thread's making
    of the batches (`making()` around it)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.restart()

    def restart(self) -> None:
        """The next step starts now (the first timed one, say)."""
        self.mark, self.made = time.process_time(), 0.0

    @contextlib.contextmanager
    def making(self) -> Iterator[None]:
        began = time.thread_time()
        try:
            yield
        finally:
            self.made += time.thread_time() - began

    def step(self) -> None:
        """A timed step ended: keep its CPU."""
        now = time.process_time()
        self.steps.append(now - self.mark - self.made)
        self.mark, self.made = now, 0.0


def phase_means(per_rank: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per rank: each phase's ms (MB for the device's) per timed step, from `take()`'s."""
    return [
        {
            key: sum(p[key] for p in ranks) / len(ranks) * (1e3 if "_mb" not in key else 1.0)
            for key in ranks[0]
        }
        if ranks
        else {}
        for ranks in per_rank
    ]


def summary_of(runs: dict[str, list[dict]], rss_bound_gib: float) -> dict[str, dict]:
    """Each variant's medians over its jobs and, beside "memory", the medians of the ratios of
    jobs run one after the other: median and mean step, the mean with the log's drains, CPU."""
    summary: dict[str, dict] = {}
    for variant, results in runs.items():
        summary[variant] = {
            "step_ms": statistics.median(r["step_ms"] for r in results),
            "mean_step_ms": statistics.median(r["mean_step_ms"] for r in results),
            "mean_with_drains_ms": statistics.median(r["mean_with_drains_ms"] for r in results),
            "cpu_step_ms": statistics.median(statistics.mean(r["cpu_step_ms"]) for r in results),
            "peak_rss_gib": max(max(r["peak_rss_gib"]) for r in results),
            "hit_rate": results[0]["hit_rate"]
            and statistics.median(r["hit_rate"] for r in results),
        }
        if "memory" not in runs or variant == "memory":
            continue
        pairs = list(zip(results, runs["memory"], strict=False))
        ratios = {
            "vs_memory": [r["step_ms"] / m["step_ms"] for r, m in pairs],
            "mean_vs_memory": [r["mean_step_ms"] / m["mean_step_ms"] for r, m in pairs],
            "mean_with_drains_vs_memory": [
                r["mean_with_drains_ms"] / m["mean_step_ms"] for r, m in pairs
            ],
            "cpu_vs_memory": [
                statistics.mean(r["cpu_step_ms"]) / statistics.mean(m["cpu_step_ms"])
                for r, m in pairs
            ],
        }
        summary[variant].update({key: statistics.median(v) for key, v in ratios.items()})
        summary[variant]["rss_bound_gib"] = rss_bound_gib
    return summary
