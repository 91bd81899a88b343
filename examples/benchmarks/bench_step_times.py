"""The cost of recording where a step's time goes: Trainer(step_times_every=N) against off.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_step_times.py --json runs/bench_step_times.json

A small CTR model (paired_steps.py's sharded tables, RowWiseAdagrad, uniform ids; their pooled
values into a DDP MLP head, Adam, a pipelined Trainer) is trained in the same processes with
step times off, on every 10th step and on every step, in rotating order per repeat. A step is
one loop iteration, from one `training_step` call to the next (so a timed step's gather and
record are inside it), the slowest rank's. On a shared machine a mean over steps follows the
stalls, so a fit's milliseconds per step are robust and still charge the timed steps in full:
with one step in N timed, ((N - 1) x the median untimed step + the median timed step) / N.
The summary gives each variant's median over repeats, the median of its per-repeat ratio to
off, and the last every-step fit's milliseconds per phase (the median of its `time/` records):
where this model's step goes. Metrics are recorded once, at the end, outside the measured steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import environment_info, median, write_json
from paired_steps import build_tables, parse_args, workload
from torch import nn

import manualpar as mp
from manualpar.embeddings import SparseFeatures

VARIANTS = {"off": None, "every_10": 10, "every_step": 1}
Batch = tuple[SparseFeatures, torch.Tensor]


class Ctr(mp.ParallelModule):
    """Sharded tables, their pooled values concatenated into an MLP that predicts a click."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        torch.manual_seed(0)  # the same head on every rank
        width = args.tables * args.dim
        self.head: nn.Module = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))
        self.calls: list[float] = []

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.sparse = build_tables(self.args, strategy)
        self.head = mp.ddp(self.head, strategy)

    def prefetch(self, batch: Batch) -> None:
        self.sparse.prefetch(batch[0])

    def training_step(self, batch: Batch, step: int) -> torch.Tensor:
        self.calls.append(time.perf_counter())  # one a step: where each step begins
        features, clicks = batch
        logits = self.head(self.sparse(features).values).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, clicks)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=1e-3)


def batches(pool: list[Batch]) -> Callable[[int, mp.ManualParallelStrategy], Batch]:
    """The workload's batches by step, a new SparseFeatures each read (a prefetched batch is
    matched by identity)."""

    def data(index: int, strategy: mp.ManualParallelStrategy) -> Batch:
        features, clicks = pool[index % len(pool)]
        return type(features)(features.keys, features.values, features.lengths), clicks

    return data


def fit_ms(
    args: argparse.Namespace, strategy: mp.ManualParallelStrategy, pool: list, every: int | None
) -> tuple[dict[str, Any], Path]:
    """A fresh fit of warmup + steps + 1 steps: its ms per step (see the module docstring), the
    median untimed and timed steps and how many were timed; and its out_dir."""
    out = Path(strategy.broadcast(tempfile.mkdtemp(prefix="bench_step_times_")))
    steps = args.warmup + args.steps + 1
    trainer = mp.Trainer(
        strategy, out, max_steps=steps, log_every=steps, progress=False, step_times_every=every
    )
    model = Ctr(args)
    trainer.fit(model, batches(pool))
    starts = torch.tensor(model.calls, dtype=torch.float64)
    seconds = strategy.all_reduce(starts.diff(), op="max")[args.warmup :].tolist()
    measured = range(args.warmup, args.warmup + args.steps)  # step k: seconds[k - warmup]
    is_timed = [bool(every) and (k + 1) % (every or 1) == 0 for k in measured]
    timed = [1000 * t for t, on in zip(seconds, is_timed, strict=True) if on]
    untimed = [1000 * t for t, on in zip(seconds, is_timed, strict=True) if not on]
    result = {
        "untimed_ms": median(untimed) if untimed else None,
        "timed_ms": median(timed) if timed else None,
        "timed_steps": len(timed),
    }
    if every is None or not timed:
        result["ms"] = median(untimed)
    elif every == 1:
        result["ms"] = median(timed)
    else:
        result["ms"] = ((every - 1) * median(untimed) + median(timed)) / every
    return result, out


def breakdown_ms(out: Path) -> dict[str, float]:
    """The median of each `time/` value over the run's records, in ms."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    timed = [r for r in map(json.loads, lines) if "time/step" in r]
    names = [k for k in timed[0] if k.startswith("time/")] if timed else []
    return {name: 1000 * median([r[name] for r in timed]) for name in names}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], plan="table_wise", steps=50)
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    generator = torch.Generator().manual_seed(strategy.rank)
    features = workload(args, strategy, 10)
    pool = [
        (f, torch.randint(0, 2, (f.batch_size,), generator=generator).float()) for f in features
    ]
    repeats, breakdown = [], {}
    names = list(VARIANTS)
    for repeat in range(args.repeats):
        shift = repeat % len(names)
        fits = {}
        for name in names[shift:] + names[:shift]:
            fits[name], out = fit_ms(args, strategy, pool, VARIANTS[name])
            if name == "every_step" and strategy.is_global_zero:
                breakdown = breakdown_ms(out)
            strategy.barrier()
            if strategy.is_global_zero:
                shutil.rmtree(out)
        repeats.append({f"{name}_ms": fits[name]["ms"] for name in names} | {"fits": fits})
    summary: dict[str, Any] = {f"{n}_ms": median([r[f"{n}_ms"] for r in repeats]) for n in names}
    summary["ratio"] = {
        n: median([r[f"{n}_ms"] / r["off_ms"] for r in repeats]) for n in names if n != "off"
    }
    if strategy.is_global_zero:
        ratio = summary["ratio"]
        print(
            f"{args.plan}: {summary['off_ms']:.2f} ms/step off; timed every 10th step "
            f"x{ratio['every_10']:.3f}, every step x{ratio['every_step']:.3f}",
            flush=True,
        )
        print("  a timed step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in breakdown.items()))
        write_json(
            args.json,
            {
                "args": vars(args),
                "repeats": repeats,
                **summary,
                "breakdown_ms": breakdown,
                "environment": environment_info(strategy),
            },
        )
    strategy.teardown()


if __name__ == "__main__":
    main()
