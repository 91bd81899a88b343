"""Shared pieces of the benchmarks: timing a step as the max over ranks, medians, JSON output.

Absolute times on shared machines swing up to 2x within an hour, so every benchmark runs its
baseline and its candidate in the same processes, interleaved and repeated, and reports ratios.
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import manualpar as mp


def time_steps(
    strategy: mp.ManualParallelStrategy, step: Callable[[], Any], steps: int, warmup: int
) -> list[float]:
    """Seconds per step, each the slowest rank's (a step ends when every rank finished it)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        strategy.barrier()
        started = time.perf_counter()
        step()
        elapsed = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
        times.append(strategy.all_reduce(elapsed, op="max").item())
    return times


def compare_builders(
    strategy: mp.ManualParallelStrategy,
    family: str,
    build: Mapping[str, Callable[[], torch.nn.Module]],
    x: torch.Tensor,
    *,
    steps: int,
    warmup: int,
    repeats: int,
) -> dict[str, Any]:
    """Adam training steps of `build["baseline"]()` against `build["manualpar"]()` (each built
    fresh per repeat), interleaved in alternating order; per-repeat times, ratios and their
    median, printed on rank 0."""
    per_repeat: dict[str, list[float]] = {"baseline": [], "manualpar": []}
    for repeat in range(repeats):
        order = list(per_repeat) if repeat % 2 == 0 else list(reversed(per_repeat))
        for name in order:
            model = build[name]()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

            def step(
                model: torch.nn.Module = model, optimizer: torch.optim.Optimizer = optimizer
            ) -> None:
                optimizer.zero_grad(set_to_none=True)
                model(x).pow(2).mean().backward()
                optimizer.step()

            per_repeat[name].append(median(time_steps(strategy, step, steps, warmup)))
    ratios = [m / b for m, b in zip(per_repeat["manualpar"], per_repeat["baseline"], strict=True)]
    if strategy.is_global_zero:
        print(
            f"{family:8s} baseline {median(per_repeat['baseline']) * 1e3:8.2f} ms/step  "
            f"manualpar {median(per_repeat['manualpar']) * 1e3:8.2f} ms/step  "
            f"ratio {median(ratios):.3f}x  (per repeat: "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + ")",
            flush=True,
        )
    return {
        "baseline_ms": [t * 1e3 for t in per_repeat["baseline"]],
        "manualpar_ms": [t * 1e3 for t in per_repeat["manualpar"]],
        "ratios": ratios,
        "median_ratio": median(ratios),
    }


def cycling_step(emb: Any, data: list) -> Callable[[], None]:
    """A training step of the sharded collection `emb` on the next batch of `data` (cycling),
    with a loss that touches every pooled value."""
    position = [0]

    def step() -> None:
        features = data[position[0] % len(data)]
        position[0] += 1
        emb(features).values.square().mean().backward()

    return step


def endless(pool: list[Any]) -> Iterator[Any]:
    """The pool's batches (SparseFeatures) round and round, a new object each time (a
    prefetched batch is matched by identity)."""
    index = 0
    while True:
        batch = pool[index % len(pool)]
        yield type(batch)(batch.keys, batch.values, batch.lengths)
        index += 1


def stepper(emb: Any, batches: Iterator[Any]) -> Callable[[], None]:
    """A training step of `emb` on `next(batches)`, with cycling_step's loss."""

    def step() -> None:
        emb(next(batches)).values.square().mean().backward()

    return step


def pipelined_step(emb: Any, data: list, strategy: mp.ManualParallelStrategy) -> Callable[[], None]:
    """cycling_step's step through TrainPipeline: each step's next batch is prefetched (its ids
    sent to their owners, or raw ids to their remappers) before the step runs; the pipeline's
    own cost (its agreement, the prefetch) is inside the step."""
    return stepper(emb, iter(mp.TrainPipeline(endless(data), strategy, emb.prefetch)))


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def peak_rss_gb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def environment_info(strategy: mp.ManualParallelStrategy) -> dict[str, Any]:
    return {
        "torch": str(torch.__version__),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "world_size": strategy.world_size,
        "threads_per_process": torch.get_num_threads(),
        "device": str(strategy.device),
    }


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")
