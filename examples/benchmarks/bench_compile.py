"""torch.compile on the recommender example: step time eager against compiled, compile time apart.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/benchmarks/bench_compile.py --json runs/bench_compile.json

The model is examples/recsys/model.py's DLRM (sharded tables, bottom and top MLPs under ddp(), a
dot interaction) on synthetic Criteo batches. Two measurements, each eager against compiled:

- "step": a whole training step, `torch.compile(model)`: forward, loss, backward (the tables'
  fused update included) and Adam's step. The sharded lookup runs eagerly in both variants (a
  graph break by design, see docs/embeddings-training.md), so this is what a user of the example
  gains.
- "dense": the dense part alone, `torch.compile(model.dense_forward)` on fixed pooled embeddings
  (a leaf that requires grad, so backward computes their gradient as in a real step): bottom MLP,
  interaction, top MLP, loss, backward with DDP's all-reduce, Adam's step.

Each repeat compiles afresh (torch._dynamo.reset()) and times the compiled model's first training
step on its own (compile time: that step minus the eager step's median; the dense part's own
compile happens in its warm-up and is not reported); the first repeat compiles with an empty
inductor cache (a fresh cache folder per run, unless TORCHINDUCTOR_CACHE_DIR is set), later ones
find their kernels cached. Then `--steps` steps after `--warmup` (at least 1) are timed per
variant, eager and compiled alternating in order; the ratio compiled / eager of the medians is
reported per repeat and overall (median of the repeats' ratios).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import environment_info, median, time_steps, write_json

import manualpar as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recsys"))  # the example
from data import SyntheticCriteo, make_tables, table_rows
from model import DLRM

Step = Callable[[], Any]


def first_call_seconds(strategy: mp.ManualParallelStrategy, step: Step) -> float:
    """The slowest rank's time for one call (for a compiled step: tracing and compiling)."""
    strategy.barrier()
    started = time.perf_counter()
    step()
    elapsed = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
    return float(strategy.all_reduce(elapsed, op="max").item())


def make_steps(
    model: DLRM,
    optimizer: torch.optim.Optimizer,
    batches: list,
    compiled: bool,
    backend: str = "inductor",
) -> dict[str, Step]:
    """The two measured steps of `model`, eager or through torch.compile with `backend`."""
    forward = torch.compile(model, backend=backend) if compiled else model
    dense_forward = (
        torch.compile(model.dense_forward, backend=backend) if compiled else model.dense_forward
    )
    device = batches[0].dense.device
    pooled = torch.randn(len(batches[0]), len(model.tables) * model.dim, device=device)
    pooled.requires_grad_(True)
    counter = iter(range(10**9))

    def train_step() -> None:
        batch = batches[next(counter) % len(batches)]
        loss = F.binary_cross_entropy_with_logits(forward(batch), batch.labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def dense_step() -> None:
        batch = batches[next(counter) % len(batches)]
        logits = dense_forward(batch.dense, pooled)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        optimizer.zero_grad(set_to_none=True)
        pooled.grad = None
        loss.backward()
        optimizer.step()

    return {"step": train_step, "dense": dense_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048, help="global batch (all ranks)")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--bottom", default="64")
    parser.add_argument("--top", default="128,64")
    parser.add_argument("--max-rows", type=int, default=100_000, help="cap on rows per table")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first compiled dense step compiles it")
    strategy = mp.ManualParallelStrategy()
    cache = Path(tempfile.mkdtemp(prefix=f"bench-compile-rank{strategy.rank}-"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))  # first compile: cold
    rows = table_rows("kaggle", args.max_rows)
    with mp.empty_init():
        model = DLRM(
            make_tables(rows, args.dim),
            bottom=[int(s) for s in args.bottom.split(",")],
            top=[int(s) for s in args.top.split(",")],
        )
    model.setup(strategy)
    optimizer = model.configure_optimizers()
    data = SyntheticCriteo(rows, batch_size=args.batch)
    batches = [data.train(step, strategy) for step in range(4)]
    names = ("step", "dense")
    times: dict[str, dict[str, list[float]]] = {n: {"eager": [], "compiled": []} for n in names}
    compile_s: list[float] = []
    for repeat in range(args.repeats):
        torch._dynamo.reset()
        steps = {
            "eager": make_steps(model, optimizer, batches, compiled=False),
            "compiled": make_steps(model, optimizer, batches, compiled=True, backend=args.backend),
        }
        first = first_call_seconds(strategy, steps["compiled"]["step"])
        order = ["eager", "compiled"] if repeat % 2 == 0 else ["compiled", "eager"]
        for name in names:
            for mode in order:
                measured = time_steps(strategy, steps[mode][name], args.steps, args.warmup)
                times[name][mode].append(median(measured))
        compile_s.append(first - times["step"]["eager"][-1])
    results: dict[str, dict] = {}
    for name in names:
        eager, compiled = times[name]["eager"], times[name]["compiled"]
        ratios = [c / e for c, e in zip(compiled, eager, strict=True)]
        results[name] = {
            "eager_ms": [t * 1e3 for t in eager],
            "compiled_ms": [t * 1e3 for t in compiled],
            "ratios": ratios,
            "median_ratio": median(ratios),
        }
        if strategy.is_global_zero:
            print(
                f"{name:5s} eager {median(eager) * 1e3:7.2f} ms/step  compiled "
                f"{median(compiled) * 1e3:7.2f} ms/step  ratio {median(ratios):.3f}x  "
                f"(per repeat: {', '.join(f'{r:.3f}' for r in ratios)})",
                flush=True,
            )
    if strategy.is_global_zero:
        print(
            f"compile (the model's first compiled step less an eager one): {compile_s[0]:.1f} s "
            f"cold; cached: {', '.join(f'{s:.1f}' for s in compile_s[1:]) or '-'} s",
            flush=True,
        )
    if strategy.is_global_zero:
        write_json(
            args.json,
            {
                "benchmark": "bench_compile",
                "config": vars(args),
                "environment": environment_info(strategy),
                "results": results,
                "compile_s": {"cold": compile_s[0], "cached": compile_s[1:]},
            },
        )
    shutil.rmtree(cache, ignore_errors=True)
    strategy.teardown()


if __name__ == "__main__":
    main()
