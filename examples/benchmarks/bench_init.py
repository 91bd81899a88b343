"""Init benchmarks, each a fresh 2-process torchrun job per measurement, variants interleaved.

    python examples/benchmarks/bench_init.py --gb 2 --repeats 3 --json runs/bench_init.json
    python examples/benchmarks/bench_init.py --embeddings --repeats 6 --small-pages \
        --peer-python .venv-torchrec/bin/python --json runs/bench_init_embeddings.json
    python examples/benchmarks/bench_init.py --embeddings --warm --repeats 5 \
        --peer-python .venv-torchrec/bin/python --json runs/bench_init_embeddings_warm.json

Dense (default): meta init + fsdp() against eager init + fsdp(), time per GB and peak RSS per
rank. "eager" builds the full model on every rank and then shards it; "meta" builds it under
empty_init() and lets fsdp() materialize only the local shard. Target for meta: peak RSS <= 1.1 x
local shard + 0.5 GB.

--embeddings: `shard_embeddings` from meta against TorchRec's DistributedModelParallel on the same
tables (the embedding benchmark's workload: 8 x 1M x 64 fp32, fused row-wise Adagrad, table-wise
or row-wise), from the module on meta to the sharded module, imports excluded. Each job reports
the slowest rank's wall, CPU (user + system of every thread: page faults count, and it is
steadier than wall on a loaded host) and system seconds; variants rotate and the report gives
the median of the per-repeat ratios. `--small-pages` adds manualpar without huge pages;
`--warm` times a second build after one built and freed in the same process, so that both get
pages the process just gave back (on a virtual machine, fresh pages can cost more than the
build).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
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


def embeddings_manualpar(args: argparse.Namespace) -> None:
    """`shard_embeddings` of the workload's tables, from meta; wall and CPU, slowest rank."""
    import torch

    import manualpar as mp
    from manualpar.embeddings import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingPlan,
        RowWiseAdagrad,
        row_wise,
        shard_embeddings,
        table_wise,
    )

    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    world = strategy.world_size
    tables = [
        EmbeddingBagConfig(f"t{i}", args.rows, args.dim, feature_names=(f"f{i}",))
        for i in range(args.tables)
    ]
    placement = {
        t.name: table_wise(i * world // args.tables) if args.plan == "table_wise" else row_wise()
        for i, t in enumerate(tables)
    }
    plan, rule = EmbeddingPlan(world, placement), RowWiseAdagrad(lr=args.lr, eps=1e-8)

    def build() -> torch.nn.Module:
        with mp.empty_init():
            ebc = EmbeddingBagCollection(tables)
        return shard_embeddings(ebc, strategy, plan, rule)

    if args.warm:
        _build_and_free(build)
    strategy.barrier()
    started = _clocks()
    built = build()  # held until measured: freeing it is not init
    _write_init(args, "manualpar", started)
    del built
    strategy.teardown()


def embeddings_torchrec(args: argparse.Namespace) -> None:
    """TorchRec's DistributedModelParallel on the same tables (peer_torchrec.build_model), run
    from the peer's environment; never imports manualpar."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from peer_torchrec import build_model

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    if args.warm:
        _build_and_free(lambda: build_model(args, dist.get_rank(), dist.get_world_size()))
    dist.barrier()
    started = _clocks()
    built = build_model(args, dist.get_rank(), dist.get_world_size())
    _write_init(args, "torchrec", started)
    del built
    dist.destroy_process_group()


def _build_and_free(build: Callable[[], object]) -> None:
    """--warm: build once and free it, so that the timed build gets the pages this process just
    gave back instead of fresh ones (on a virtual machine, pages fresh from the host can cost
    more than the build itself)."""
    build()
    gc.collect()


CLOCKS = ("init_s", "init_cpu_s", "init_sys_s")  # wall; user + system (all threads); system


def _clocks() -> tuple[float, float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_utime + usage.ru_stime, usage.ru_stime


def _write_init(args: argparse.Namespace, variant: str, started: tuple[float, ...]) -> None:
    """The slowest rank's seconds since `started` on each clock and every rank's peak RSS,
    written by rank 0."""
    import torch
    import torch.distributed as dist
    from embedding_workload import peak_rss_gb

    now = _clocks()
    spent = torch.tensor([b - a for a, b in zip(started, now, strict=True)], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    peaks: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_rss_gb())
    if dist.get_rank() == 0:
        record = {"variant": variant, "plan": args.plan, "peak_rss_gb_per_rank": peaks}
        record |= dict(zip(CLOCKS, spent.tolist(), strict=True))
        Path(args.result).write_text(json.dumps(record))


def launch(python: str, worker_args: list[str], env: dict[str, str] | None = None) -> dict:
    """One fresh 2-process torchrun job of this script; its rank 0's JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            *worker_args,
            "--result",
            result,
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(HERE.parents[1]),
            **(env or {}),
        }
        run = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True)
        if not os.path.exists(result):
            raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
        if run.returncode:  # measured and written, then died on the way out: keep, but say so
            print(f"  (exit code {run.returncode} after writing its result)", flush=True)
        return json.loads(Path(result).read_text())


def dense(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {"eager": [], "meta": []}
    for repeat in range(args.repeats):
        for variant in ("eager", "meta") if repeat % 2 == 0 else ("meta", "eager"):
            runs[variant].append(
                launch(sys.executable, ["--worker", variant, "--gb", str(args.gb)])
            )
            run = runs[variant][-1]
            print(
                f"repeat {repeat} {variant:5s}: {run['seconds']:.2f}s "
                f"({run['seconds_per_gb']:.2f} s/GiB), peak RSS per rank "
                f"{max(run['peak_rss_gb_per_rank']):.2f} GiB, local shard "
                f"{run['local_shard_gb']:.2f} GiB",
                flush=True,
            )
    summary: dict = {}
    for variant, items in runs.items():
        summary[variant] = {
            "seconds_per_gb": statistics.median([r["seconds_per_gb"] for r in items]),
            "peak_rss_gb": statistics.median([max(r["peak_rss_gb_per_rank"]) for r in items]),
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
    return {"runs": runs, "summary": summary}


def embeddings(args: argparse.Namespace) -> dict:
    if not args.peer_python:
        raise SystemExit("--embeddings compares with TorchRec: pass --peer-python")
    workload = [f"--{key}={getattr(args, key)}" for key in ("plan", "tables", "rows", "dim")]
    workload += ["--warm"] if args.warm else []
    mine = ["--worker", "embeddings-manualpar", *workload]
    jobs = {
        "manualpar": (sys.executable, mine, {}),
        "torchrec": (args.peer_python, ["--worker", "embeddings-torchrec", *workload], {}),
    }
    if args.small_pages:  # the tables on 4 KiB pages (kernels/row_memory.py)
        jobs["manualpar 4k pages"] = (sys.executable, mine, {"MANUALPAR_HUGE_PAGES": "0"})
    names = list(jobs)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            run = launch(*jobs[name])
            runs[name].append(run)
            print(
                f"repeat {repeat} {name:18s}: wall {run['init_s']:.2f} s, CPU "
                f"{run['init_cpu_s']:.2f} s (system {run['init_sys_s']:.2f} s), peak RSS "
                f"{max(run['peak_rss_gb_per_rank']):.2f} GiB (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    summary: dict[str, float] = {}
    for name in names:
        for key in CLOCKS:
            summary[f"{name} median {key}"] = statistics.median(r[key] for r in runs[name])
        if name != "torchrec":
            pairs = list(zip(runs[name], runs["torchrec"], strict=True))
            for key in CLOCKS[:2]:
                summary[f"{name}/torchrec {key}"] = statistics.median(
                    a[key] / b[key] for a, b in pairs
                )
    print(json.dumps(summary, indent=1))
    return {"runs": runs, "summary": summary}


WORKERS = ("eager", "meta", "embeddings-manualpar", "embeddings-torchrec")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="full model size in GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--embeddings", action="store_true", help="shard_embeddings vs TorchRec")
    parser.add_argument("--peer-python", help="TorchRec's interpreter (.venv-torchrec)")
    parser.add_argument(
        "--small-pages", action="store_true", help="also manualpar with MANUALPAR_HUGE_PAGES=0"
    )
    parser.add_argument("--plan", choices=("table_wise", "row_wise"), default="table_wise")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument(
        "--warm",
        action="store_true",
        help="time a second build, after one built and freed in the same process",
    )
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker in ("eager", "meta"):
        worker(args.worker, args.gb, args.result)
        return
    if args.worker is not None:  # the peer's build_model reads the workload's settings
        args.lr, args.dtype, args.sequence = 0.01, "fp32", False
        run = embeddings_manualpar if args.worker == "embeddings-manualpar" else embeddings_torchrec
        run(args)
        return
    report = embeddings(args) if args.embeddings else dense(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        name = "bench_init_embeddings" if args.embeddings else "bench_init"
        Path(args.json).write_text(
            json.dumps({"benchmark": name, "config": vars(args), **report}, indent=1)
        )


if __name__ == "__main__":
    main()
