"""One process's sharded-table step with glibc's thresholds as the strategy fixes them
(manualpar.tune_malloc) and as glibc leaves them (MANUALPAR_MALLOC_TUNING=0).

Each measurement is a fresh process (the allocator's state is a process's history), the two
variants alternate in order, and each process reports its median thread time and minor page
faults per step (`getrusage`), its peak RSS and its RSS after the steps (the freed heap the trim
threshold keeps). The tables and ids are paired_steps.py's (uniform ids, row-wise Adagrad).

    python examples/benchmarks/bench_malloc.py --tables 26 --rows 200000 --dim 16 --ids-per-bag 1
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import median, write_json

VARIANTS = {"default": {"MANUALPAR_MALLOC_TUNING": "0"}, "tuned": {}}


def worker() -> None:
    """One variant in this process: thread ms and minor faults per step, RSS."""
    from paired_steps import build_tables, parse_args, workload

    import manualpar as mp

    args = parse_args(__doc__ or "", "table_wise", steps=30)
    strategy = mp.ManualParallelStrategy(num_threads=1)
    emb = build_tables(args, strategy)
    batches = workload(args, strategy, 8)

    def step(index: int) -> None:
        emb(batches[index % len(batches)]).values.square().mean().backward()

    for index in range(args.warmup):
        step(index)
    ms, faults = [], []
    for index in range(args.steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.thread_time()
        step(index)
        ms.append(1000 * (time.thread_time() - started))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(
        json.dumps(
            {
                "thread_ms": median(ms),
                "minor_faults": median(faults),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "rss_after_mb": resident / 2**20,
            }
        )
    )


def main() -> None:
    from paired_steps import parse_args

    args = parse_args(__doc__ or "", "table_wise", steps=30)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            run = subprocess.run(
                [sys.executable, __file__, "--worker", *sys.argv[1:]],
                env={**clean, **VARIANTS[name], "OMP_NUM_THREADS": "1"},
                capture_output=True,
                text=True,
                check=True,
            )
            runs[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat} {name:<8} {runs[name][-1]}", flush=True)
    pairs = list(zip(runs["tuned"], runs["default"], strict=True))
    summary: dict[str, Any] = {
        name: {key: median([r[key] for r in found]) for key in found[0]}
        for name, found in runs.items()
    }
    summary["tuned/default thread_ms"] = median([t["thread_ms"] / d["thread_ms"] for t, d in pairs])
    print(json.dumps(summary, indent=2), flush=True)
    write_json(args.json, {"args": vars(args), "runs": runs, "summary": summary})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        worker()
    else:
        main()
