"""What follows init in bench_init.py's embedding jobs: the first training steps (`--steps`), each
timed on the wall and the process's CPU clock (every thread), and the wait that makes a job's
fresh 2 MiB pages cold (`--cold-gap`).

A rank's tables on 4 KiB pages init in a quarter of the time on a virtual machine that reports
free memory to its host, but every later step pays for the smaller pages; these give the
init-plus-steps totals that weigh one against the other.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from host_memory import free_memory

__all__ = [
    "available_mib",
    "first_steps",
    "gap_note",
    "manualpar_steps",
    "steps_line",
    "torchrec_steps",
    "totals",
    "wait_cold",
]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def manualpar_steps(args: argparse.Namespace, emb: Any, rank: int, world: int) -> dict:
    """--steps: the first steps of the embedding benchmark's training on the built module."""
    from embedding_workload import batch_features

    from manualpar.embeddings import SparseFeatures

    keys = tuple(f"f{i}" for i in range(args.tables))

    def step(index: int) -> None:
        features = SparseFeatures(keys, *batch_features(args, rank, world, index))
        emb(features).values.square().mean().backward()

    return first_steps(step, args.steps)


def torchrec_steps(args: argparse.Namespace, model: Any) -> dict:
    """--steps: the same first steps on TorchRec's module (peer_torchrec.py's step)."""
    import torch.distributed as dist
    from embedding_workload import batch_features
    from torchrec import KeyedJaggedTensor

    keys = [f"f{i}" for i in range(args.tables)]
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(index: int) -> None:
        ids, lengths = batch_features(args, rank, world, index)
        features = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=lengths)
        model(features).values().square().mean().backward()

    return first_steps(step, args.steps)


def first_steps(step: Callable[[int], None], count: int) -> dict:
    """Wall and CPU milliseconds (this process, every thread) of each of the first `count` steps
    after init, the slowest rank's, with a barrier before each."""
    import torch
    import torch.distributed as dist

    walls, cpus = [], []
    for index in range(count):
        dist.barrier()
        started, cpu = time.perf_counter(), _cpu()
        step(index)
        spent = torch.tensor([time.perf_counter() - started, _cpu() - cpu], dtype=torch.float64)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        walls.append(1000 * spent[0].item())
        cpus.append(1000 * spent[1].item())
    return {"step_ms": walls, "step_cpu_ms": cpus} if count else {}


def wait_cold(seconds: float) -> float | None:
    """--cold-gap: wait, so that the free 2 MiB blocks the previous job left are reported to
    the host (cold: supplied again on first touch) instead of still backed (warm: 0.1 ms a page
    instead of 4-5 ms). Freed 2 GiB of 2 MiB pages, 1 GiB touched again after 1 s found 708 MiB
    of it warm, after 5 s 186 MiB, after 10 s 24 MiB, after 20 s 4 MiB. The MiB the kernel
    reported meanwhile (None where it does not say, or with no wait)."""
    if seconds <= 0:
        return None
    before = free_memory()["reported_mib"]
    time.sleep(seconds)
    after = free_memory()["reported_mib"]
    return None if before is None or after is None else after - before


def totals(run: dict) -> dict[str, float]:
    """--steps: the CPU seconds of the first steps, of init and them, and the median CPU ms of a
    step in their second half (the step once init's pages have settled)."""
    cpu = run["step_cpu_ms"]
    steps = sum(cpu) / 1000
    late = statistics.median(cpu[len(cpu) // 2 :])
    return {
        "steps_cpu_s": steps,
        "init_and_steps_cpu_s": run["init_cpu_s"] + steps,
        "late_step_cpu_ms": late,
    }


def steps_line(run: dict) -> str:
    """--steps: a job's steps, for its line of the report."""
    if "step_cpu_ms" not in run:
        return ""
    spent, cpu = totals(run), run["step_cpu_ms"]
    huge = [round(p.get("huge_mib") or 0) for p in run["pages_per_rank"]]
    return (
        f"; {len(cpu)} steps CPU {spent['steps_cpu_s']:.2f} s (first {cpu[0]:.0f} ms, "
        f"second half median {spent['late_step_cpu_ms']:.1f} ms), init + steps "
        f"{spent['init_and_steps_cpu_s']:.2f} s, MiB on 2 MiB pages after {huge}"
    )


def gap_note(run: dict) -> str:
    """--cold-gap: what the kernel reported during the wait before a job."""
    reported = run.get("gap_reported_mib")
    return "" if reported is None else f", {reported:.0f} MiB reported during the gap"


def available_mib() -> str:
    """The host's MemAvailable in MiB, for a job's line (others' jobs move it)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return str(int(line.split()[1]) // 1024)
    except OSError:
        pass
    return "unknown"
