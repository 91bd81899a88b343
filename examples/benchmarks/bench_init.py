"""Meta init + fsdp() against eager init + fsdp(): time per GB and peak RSS per rank.

    python examples/benchmarks/bench_init.py --gb 2 --repeats 3 --json runs/bench_init.json

Each measurement is a fresh 2-process torchrun job (peak RSS is per process), alternating the two
variants, repeated; the report gives medians and ratios. "eager" builds the full model on every
rank and then shards it; "meta" builds it under empty_init() and lets fsdp() materialize only the
local shard. Target for meta: peak RSS <= 1.1 x local shard + 0.5 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTH = 4096  # one Linear(WIDTH, WIDTH) holds 64 MiB of fp32 weights


def worker(variant: str, gb: float, result: str) -> None:
    import torch
    from bench_common import peak_rss_gb
    from torch import nn

    import manualpar as mp
    from manualpar import fsdp

    strategy = mp.ManualParallelStrategy()
    layers = max(1, round(gb * 2**30 / (WIDTH * WIDTH * 4)))
    baseline = peak_rss_gb()
    strategy.barrier()
    started = time.perf_counter()
    with mp.empty_init(enabled=variant == "meta"):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    model = fsdp(model, strategy, wrap=(nn.Linear,))
    elapsed = time.perf_counter() - started
    slowest = strategy.all_reduce(torch.tensor(elapsed, dtype=torch.float64), op="max").item()
    local_gb = sum(p.to_local().numel() * 4 for p in model.parameters()) / 2**30
    peaks = strategy.all_gather(torch.tensor([peak_rss_gb()], dtype=torch.float64))
    if strategy.is_global_zero:
        full_gb = layers * WIDTH * WIDTH * 4 / 2**30
        Path(result).write_text(
            json.dumps(
                {
                    "variant": variant,
                    "model_gb": full_gb,
                    "local_shard_gb": local_gb,
                    "seconds": slowest,
                    "seconds_per_gb": slowest / full_gb,
                    "peak_rss_gb_per_rank": peaks.flatten().tolist(),
                    "rss_before_gb": baseline,
                }
            )
        )
    strategy.teardown()


def launch(variant: str, gb: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            "--worker",
            variant,
            "--gb",
            str(gb),
            "--result",
            result,
        ]
        subprocess.run(command, check=True, cwd=Path(__file__).parent, stdout=subprocess.DEVNULL)
        return json.loads(Path(result).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="full model size in GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=["eager", "meta"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.gb, args.result)
        return
    from bench_common import median, write_json

    runs: dict[str, list[dict]] = {"eager": [], "meta": []}
    for repeat in range(args.repeats):
        for variant in ("eager", "meta") if repeat % 2 == 0 else ("meta", "eager"):
            runs[variant].append(launch(variant, args.gb))
            run = runs[variant][-1]
            print(
                f"repeat {repeat} {variant:5s}: {run['seconds']:.2f}s "
                f"({run['seconds_per_gb']:.2f} s/GiB), peak RSS per rank "
                f"{max(run['peak_rss_gb_per_rank']):.2f} GiB, local shard "
                f"{run['local_shard_gb']:.2f} GiB",
                flush=True,
            )
    summary = {}
    for variant, items in runs.items():
        summary[variant] = {
            "seconds_per_gb": median([r["seconds_per_gb"] for r in items]),
            "peak_rss_gb": median([max(r["peak_rss_gb_per_rank"]) for r in items]),
            "local_shard_gb": items[0]["local_shard_gb"],
            "model_gb": items[0]["model_gb"],
        }
    meta = summary["meta"]
    bound = 1.1 * meta["local_shard_gb"] + 0.5
    summary["meta_vs_eager_time"] = meta["seconds_per_gb"] / summary["eager"]["seconds_per_gb"]
    summary["meta_vs_eager_rss"] = meta["peak_rss_gb"] / summary["eager"]["peak_rss_gb"]
    summary["meta_rss_bound_gb"] = bound
    print(
        f"median: eager {summary['eager']['seconds_per_gb']:.2f} s/GiB, "
        f"{summary['eager']['peak_rss_gb']:.2f} GiB peak; meta "
        f"{meta['seconds_per_gb']:.2f} s/GiB, {meta['peak_rss_gb']:.2f} GiB peak "
        f"(target <= {bound:.2f} GiB: {'met' if meta['peak_rss_gb'] <= bound else 'MISSED'}); "
        f"meta/eager time {summary['meta_vs_eager_time']:.2f}x, "
        f"RSS {summary['meta_vs_eager_rss']:.2f}x"
    )
    write_json(
        args.json,
        {"benchmark": "bench_init", "config": vars(args), "runs": runs, "summary": summary},
    )


if __name__ == "__main__":
    main()
