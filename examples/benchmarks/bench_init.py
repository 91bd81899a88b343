"""Init benchmarks, each a fresh 2-process torchrun job per measurement, variants interleaved.

    python examples/benchmarks/bench_init.py --gb 2 --repeats 3 --json runs/bench_init.json
    python examples/benchmarks/bench_init.py --embeddings --repeats 6 --small-pages \
        --peer-python .venv-torchrec/bin/python --json runs/bench_init_embeddings.json
    python examples/benchmarks/bench_init.py --embeddings --warm --repeats 5 \
        --peer-python .venv-torchrec/bin/python --json runs/bench_init_embeddings_warm.json
    python examples/benchmarks/bench_init.py --embeddings --repeats 5 --small-pages \
        --cold-gap 20 --steps 100 --peer-python .venv-torchrec/bin/python \
        --json runs/bench_init_embeddings_steps.json

Dense (default): meta init + fsdp() against eager init + fsdp(), time per GB and peak RSS per
rank. "eager" builds the full model on every rank and then shards it; "meta" builds it under
empty_init() and lets fsdp() materialize only the local shard. Target for meta: peak RSS <= 1.1 x
local shard + 0.5 GB.

--embeddings: `shard_embeddings` from meta against TorchRec's DistributedModelParallel on the same
tables (the embedding benchmark's workload: 8 x 1M x 64 fp32, fused row-wise Adagrad, table-wise
or row-wise), from the module on meta to the sharded module, imports excluded. Each job reports
the slowest rank's wall, CPU (user + system of every thread: page faults count, and it is
steadier than wall on a loaded host), system seconds and minor page faults, each rank's MiB on
2 MiB pages and the same clocks inside the first touch of the rows (manualpar's `_fill_block`,
TorchRec's `torch.zeros` and `uniform_`), and the host's free memory before it (host_memory.py:
on a virtual machine that reports free blocks to its host, fresh 2 MiB pages always cost the
host's supply, 4 KiB pages only once the small free blocks run out); variants rotate and the
report gives the median of the per-repeat ratios. `--small-pages` adds manualpar without huge
pages; `--warm` times a second build after one built and freed in the same process, so that both get
pages the process just gave back (on a virtual machine, fresh pages can cost more than the
build). `--cold-gap SECONDS` waits before each job until the 2 MiB blocks the previous one freed
are reported to the host, so that every job starts cold (init_steps.py); `--steps N` also times
the first N training steps after init (the embedding benchmark's batches), for the init plus
steps totals that weigh 4 KiB pages' cheaper init against their slower step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import init_steps
import job_launch
from host_memory import free_memory, huge_mib

WIDTH = 4096  # one Linear(WIDTH, WIDTH) holds 64 MiB of fp32 weights


def worker(variant: str, gb: float, result: str) -> None:
    import torch
    from bench_common import peak_rss_gb
    from torch import nn
    from torch.distributed.tensor import DTensor

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
    sharded = fsdp(model, strategy, wrap=(nn.Linear,))
    elapsed = time.perf_counter() - started
    slowest = strategy.all_reduce(torch.tensor(elapsed, dtype=torch.float64), op="max").item()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in sharded.parameters()]
    local_gb = sum(p.numel() * 4 for p in local) / 2**30
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
    import manualpar.embeddings.sharded.table_storage as table_storage

    table_storage._fill_block = _phase("fill", table_storage._fill_block)  # the rows' first touch
    strategy.barrier()
    before, started = free_memory(), _clocks()
    built = build()  # held until measured: freeing it is not init
    ended, HUGE_AT_INIT[:] = _clocks(), [huge_mib() or 0.0]
    steps = init_steps.manualpar_steps(args, built, strategy.rank, world)
    _write_init(args, "manualpar", (started, ended), before, steps)
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
    torch.zeros = _phase("torch.zeros", torch.zeros)  # FBGEMM's weights: one zeroed block
    # then each table's values
    torch.Tensor.uniform_ = _phase("uniform_", torch.Tensor.uniform_)  # type: ignore[method-assign]
    dist.barrier()
    before, started = free_memory(), _clocks()
    built = build_model(args, dist.get_rank(), dist.get_world_size())
    ended = _clocks()
    _write_init(args, "torchrec", (started, ended), before, init_steps.torchrec_steps(args, built))
    del built
    dist.destroy_process_group()


def _build_and_free(build: Callable[[], object]) -> None:
    """--warm: build once and free it, so that the timed build gets the pages this process just
    gave back instead of fresh ones (on a virtual machine, pages fresh from the host can cost
    more than the build itself)."""
    build()
    gc.collect()


# wall; user + system (all threads); system; minor page faults (a 2 MiB page is one)
CLOCKS = ("init_s", "init_cpu_s", "init_sys_s", "init_faults")
PHASES: dict[str, list[float]] = {}  # name: the CLOCKS spent inside its calls (`_phase`)
HUGE_AT_INIT: list[float] = []  # this rank's MiB on 2 MiB pages when init returned


def _clocks() -> tuple[float, float, float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter(), cpu, usage.ru_stime, float(usage.ru_minflt)


def _phase(name: str, function: Callable) -> Callable:
    """`function`, adding what each call spends on every clock to PHASES[name]."""

    def timed(*args: object, **kwargs: object) -> object:
        started = _clocks()
        try:
            return function(*args, **kwargs)
        finally:
            spent = [b - a for a, b in zip(started, _clocks(), strict=True)]
            PHASES[name] = [a + b for a, b in zip(PHASES.get(name, [0.0] * 4), spent, strict=True)]

    return timed


def _write_init(
    args: argparse.Namespace,
    variant: str,
    span: tuple[tuple[float, ...], tuple[float, ...]],
    before: dict,
    steps: dict | None = None,
) -> None:
    """The slowest rank's seconds since `started` on each clock, every rank's peak RSS, MiB on
    2 MiB pages and phases, and the host's free memory `before` (rank 0's), written by rank 0."""
    import torch
    import torch.distributed as dist
    from embedding_workload import peak_rss_gb

    spent = torch.tensor([b - a for a, b in zip(*span, strict=True)], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    peaks: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_rss_gb())
    pages: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(
        pages, {"huge_mib": huge_mib(), "huge_mib_at_init": HUGE_AT_INIT, "phases": PHASES}
    )
    if dist.get_rank() == 0:
        record = {"variant": variant, "plan": args.plan, "peak_rss_gb_per_rank": peaks}
        record |= {"free_memory_before": before, "pages_per_rank": pages}
        record |= dict(zip(CLOCKS, spent.tolist(), strict=True)) | (steps or {})
        Path(args.result).write_text(json.dumps(record))


def launch(python: str, worker_args: list[str], env: dict[str, str] | None = None) -> dict:
    """One fresh 2-process torchrun job of this script; its rank 0's JSON result (run from the
    caller's directory: a relative --peer-python is the caller's)."""
    return job_launch.launch(python, __file__, worker_args, env=env)


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
    workload += [f"--steps={args.steps}"]
    mine = ["--worker", "embeddings-manualpar", *workload]
    jobs: dict[str, tuple[str, list[str], dict[str, str]]] = {
        "manualpar": (sys.executable, mine, {}),
        "torchrec": (args.peer_python, ["--worker", "embeddings-torchrec", *workload], {}),
    }
    if args.small_pages:  # the tables on 4 KiB pages (kernels/row_memory.py)
        jobs["manualpar 4k pages"] = (sys.executable, mine, {"MANUALPAR_HUGE_PAGES": "0"})
    names = list(jobs)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            reported = init_steps.wait_cold(args.cold_gap)
            run = launch(*jobs[name]) | {"gap_reported_mib": reported}
            runs[name].append(run)
            print(
                f"repeat {repeat} {name:18s}: wall {run['init_s']:.2f} s, CPU "
                f"{run['init_cpu_s']:.2f} s (system {run['init_sys_s']:.2f} s), peak RSS "
                f"{max(run['peak_rss_gb_per_rank']):.2f} GiB, {run['init_faults']:.0f} faults, "
                f"{max(p['huge_mib'] or 0 for p in run['pages_per_rank']):.0f} MiB on 2 MiB pages; "
                f"host memory free in small blocks {_mib(run, 'free_below_order_mib')} "
                f"(load {os.getloadavg()[0]:.1f}, MemAvailable {init_steps.available_mib()} MiB"
                + init_steps.gap_note(run)
                + ")"
                + init_steps.steps_line(run),
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
            if args.steps:
                for key in ("steps_cpu_s", "init_and_steps_cpu_s", "late_step_cpu_ms"):
                    summary[f"{name}/torchrec {key}"] = statistics.median(
                        init_steps.totals(a)[key] / init_steps.totals(b)[key] for a, b in pairs
                    )
        if args.steps:
            for key in ("steps_cpu_s", "init_and_steps_cpu_s", "late_step_cpu_ms"):
                summary[f"{name} median {key}"] = statistics.median(
                    init_steps.totals(r)[key] for r in runs[name]
                )
    print(json.dumps(summary, indent=1))
    return {"runs": runs, "summary": summary}


def _mib(run: dict, key: str) -> str:
    value = run["free_memory_before"][key]
    return "unknown" if value is None else f"{value:.0f} MiB"


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
    parser.add_argument(
        "--steps", type=int, default=0, help="also time the first STEPS training steps after init"
    )
    parser.add_argument(
        "--cold-gap",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait SECONDS before each job, so that the 2 MiB blocks the previous job freed are "
        "reported to the host and the next job's are cold (10-20 s measured enough)",
    )
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker in ("eager", "meta"):
        worker(args.worker, args.gb, args.result)
        return
    if args.worker is not None:  # the peer's build_model reads the workload's settings
        args.lr, args.dtype, args.sequence = 0.01, "fp32", False
        args.batch, args.ids_per_bag = 2048, 20  # the embedding benchmark's batches
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
