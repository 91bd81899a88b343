"""Tables larger than memory: the disk tier's step against in-memory tables, LRU against LFU.

    python examples/benchmarks/bench_disk_tier.py --disk-gb 36 --memory-gb 8 --cache-gb 2 \
        --steps 200 --repeats 3 --dir runs/disk_tier --json runs/bench_disk_tier.json
        [--baseline-src ../manualpar-before --variants memory lrfu lrfu-baseline]

Each measurement is a fresh 2-process torchrun job; the variants (in-memory tables of `--memory-gb`
in total, the largest that fit next to everything else; disk tables of `--disk-gb` with an LRU
cache; the same with LFU or LRFU (`lfu`, `lrfu`); any of them with `-pipelined`, e.g.
`lru-pipelined`: the steps through TrainPipeline, each batch's rows read into the cache during the
step before, the pipeline's `next` timed inside the step; with `-inplace`, e.g. `lru-inplace`: no
write log, evicted rows written to their places, as before the log; with `-io<N>` after the policy,
e.g. `lru-io1`: `DiskTier(io_threads=N)`; ending `-log<N>`, e.g. `lru-log11`: a write log of N
cache sizes, `DiskTier(write_log=N)`; `<policy>-baseline`, e.g. `lrfu-baseline`: that policy from
`--baseline-src`'s tree, the named ones only, else `lru-baseline`) alternate in a rotating order,
`--repeats` times. Workload: `--tables` tables of 64 fp32 columns, rows split over both ranks,
fused row-wise Adagrad, global batch 2048, 20 ids per bag drawn from Zipf(1.05) (rank k of the
distribution scattered over the table by a fixed permutation; with `--shift-every N` the
permutation moves every N steps, so the hot rows shift to other rows). A step is forward +
backward with the update, timed as the slowest rank's; the median (and mean: evictions come in
batches) of `--steps` after a warm-up that, on disk, lasts until every cache has been full and
evicted a quarter of its rows; time enough steps for each table to evict a batch (a sixteenth
of its cache), or the mean misses the evictions (a job whose timed steps evicted nothing says so).
Reported: step-time ratio disk / memory (median over repeats of the per-repeat ratios), peak RSS
per process against cache + 1 GiB, the cache hit rate over the timed steps, and the CPU a timed
step takes (every thread of the process, the drain's and the writes' too, less the making of the
batches; `cpu_vs_memory`): on a loaded host the wall time counts the waits for a core, and its
ratios swing between repeats. With a write log,
the logged rows are then written to their places, timed (`drain_s`, slowest rank), and that cost
spread over the steps that fill a log (`drain_ms_per_step`: the drain's time per row, times the
share of appended rows still in the log, times the rows appended per timed step) is added to the
mean (`mean_with_drains_ms`): the cost of the writes the log only defers. With `--cycle`, disk
jobs instead warm up until every write log has drained once and are timed until each has
drained once more (at least `--steps`): a whole log cycle, whose plain mean is the cost per
step. Each disk job also reports, per rank, the milliseconds per timed step of each of the
tier's phases, wall and CPU (`cpu_` keys), and the device MB read and written
(disk_phases.py). Table files are created under `--dir` and deleted after each job.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import job_launch
from disk_phases import PhaseClock, StepCPU, phase_means, summary_of

if TYPE_CHECKING:  # (imported where used: the launcher itself never loads torch)
    import torch

GIB = 2**30
PERMUTE = 2_654_435_761  # Knuth's multiplicative hash constant, a prime: a fixed permutation
SHIFT = 1_000_003  # a prime: where the permutation moves each `--shift-every` steps


def zipf_ids(rows: int, count: int, seed: int, exponent: float, epoch: int = 0) -> torch.Tensor:
    """`count` ids in [0, rows): Zipf ranks (too-large draws redrawn), scattered by a permutation
    so the hot rows are not neighbours; each `epoch` moves the permutation by a prime, so every
    rank lands on another row (the hot rows shift)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    out = np.empty(0, dtype=np.int64)
    while out.size < count:
        draw = rng.zipf(exponent, size=2 * count)
        out = np.concatenate([out, draw[draw <= rows][: count - out.size]])
    ids = ((out - 1) * PERMUTE + epoch * SHIFT) % rows
    return torch.from_numpy(ids)


def worker(args: argparse.Namespace) -> None:
    import torch

    import manualpar as mp
    from manualpar.embeddings import (
        DiskTier,
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingPlan,
        RowWiseAdagrad,
        SparseFeatures,
        row_wise,
        shard_embeddings,
    )
    from manualpar.embeddings.storage.disk_tier import DiskTable, hit_rate

    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    base, _, log_size = args.variant.partition(LOG)
    base = base.removesuffix(PIPELINED)
    in_place = base.endswith(IN_PLACE)
    base = base.removesuffix(IN_PLACE)
    write_log = 0.0 if in_place else float(log_size) if log_size else None
    io = re.search(r"-io(\d+)$", base)
    base = base.removesuffix(io.group(0)) if io else base
    disk = base != "memory"
    total = (args.disk_gb if disk else args.memory_gb) * GIB
    row_bytes = args.dim * 4 + 4
    rows = int(total // (args.tables * row_bytes))
    tables = [
        EmbeddingBagConfig(f"t{i}", rows, args.dim, feature_names=(f"f{i}",))
        for i in range(args.tables)
    ]
    placement = row_wise(on_disk=True) if disk else row_wise()
    plan = EmbeddingPlan(world, {t.name: placement for t in tables})
    options: dict[str, Any] = {"write_log": write_log} if write_log is not None else {}
    options.update({"io_threads": int(io.group(1))} if io else {})
    tier = (
        DiskTier(args.dir, cache_bytes=int(args.cache_gb * GIB), policy=policy_of(base), **options)
        if disk
        else None
    )
    start = time.perf_counter()
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables, seed=0)
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.01), disk_tier=tier)
    init_s = time.perf_counter() - start
    batch = args.batch // world
    lengths = torch.full((batch * args.tables,), args.ids_per_bag, dtype=torch.int64)

    def features(step: int) -> SparseFeatures:
        ids = [
            zipf_ids(
                rows,
                batch * args.ids_per_bag,
                7919 * step + 31 * rank + t,
                args.exponent,
                step // args.shift_every if args.shift_every else 0,
            )
            for t in range(args.tables)
        ]
        return SparseFeatures(tuple(f"f{t}" for t in range(args.tables)), torch.cat(ids), lengths)

    disk_tables = [t for t in emb.storage.stores.values() if isinstance(t, DiskTable)]
    caches = [t.cache for t in disk_tables]
    clock = PhaseClock()
    if disk:
        clock.install()

    def warm(step: int) -> bool:
        """Warm-up: at least --warmup steps and, on disk, until every cache has been full and
        evicted a quarter of its rows (the steady state), at most --max-warmup steps; with
        --cycle, until every write log has drained once too (the timed steps then start a
        cycle after a drain, as every later cycle does)."""
        if step < args.warmup:
            return True
        full = all(c.evictions >= c.capacity // 4 for c in caches)
        if args.cycle:
            full = full and all(t.log.drains >= 1 for t in disk_tables)
        return not full and step < args.max_warmup

    def timing(step: int) -> bool:
        """Timed steps: --steps of them; with --cycle, on disk, until every write log has
        drained once more (a whole cycle: the log filled, drained, and read from after)."""
        assert warmup is not None
        if not (args.cycle and disk) or step < warmup + args.steps:
            return step < warmup + args.steps
        more = all(t.log.drains > drains_before[i] for i, t in enumerate(disk_tables))
        done = torch.tensor(1.0 if more or step >= warmup + args.max_cycle else 0.0)
        return float(strategy.all_reduce(done, op="min")) == 0.0

    # pipelined: the batches of the same steps through TrainPipeline. They are made here,
    # untimed, as for the plain steps (the pipeline's reading thread takes them ready), or
    # making them would take the CPU in that thread during the timed steps.
    ready: collections.deque[SparseFeatures] = collections.deque()
    made = 0  # batches made so far
    pipeline = (
        iter(mp.TrainPipeline(iter(ready.popleft, None), strategy, emb.prefetch))
        if args.variant.partition(LOG)[0].endswith(PIPELINED)
        else None
    )
    times, step, warmup, appended_before = [], 0, None, 0
    cpu = StepCPU()  # the process's CPU per timed step, less the making of the batches
    drains_before: list[int] = []
    phases: list[dict[str, float]] = []  # this rank's, a timed step each
    while warmup is None or timing(step):
        if warmup is None:
            # every rank must agree when the warm-up ends
            done = torch.tensor(0.0 if warm(step) else 1.0)
            if float(strategy.all_reduce(done, op="min")) == 1.0:
                warmup = step
                for cache in caches:
                    cache.hits = cache.misses = cache.evictions = 0
        if step == warmup:
            appended_before = sum(t.log.appended for t in disk_tables)
            drains_before = [t.log.drains for t in disk_tables]
            clock.take()
            cpu.restart()
        with cpu.making():
            batch_features = features(step) if pipeline is None else None
            while pipeline is not None and made < step + 3:  # the pipeline reads 2 ahead
                ready.append(features(made))
                made += 1
        strategy.barrier()
        begin = time.perf_counter()
        if pipeline is not None:
            batch_features = next(pipeline)  # and the next batch's input dist and rows
        emb(batch_features).values.square().mean().backward()
        elapsed = torch.tensor(time.perf_counter() - begin)
        times.append(float(strategy.all_reduce(elapsed, op="max")))
        if warmup is not None and step >= warmup:
            phases.append(clock.take())
            cpu.step()
        step += 1
    timed = times[warmup:]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    peaks = [float(p) for p in strategy.all_gather_object(peak)]
    cpu_ms = [1e3 * float(c) for c in strategy.all_gather_object(statistics.mean(cpu.steps))]
    per_rank = strategy.all_gather_object(phases)  # per rank: every timed step's phases
    appended = sum(t.log.appended for t in disk_tables)
    logged = sum(int(t.cache.logged_rows()[0].numel()) for t in disk_tables)
    strategy.barrier()
    begin = time.perf_counter()
    for table in disk_tables:
        table.log.drain("the benchmark's end")
    drain_s = float(strategy.all_reduce(torch.tensor(time.perf_counter() - begin), op="max"))
    per_step = (appended - appended_before) / len(timed)  # rows appended a timed step
    # a drain of the rows appended so far took drain_s; a log fills every `log_rows` appended
    # rows with the same share still logged, so its drain costs drain_s / appended a row
    drain_ms_per_step = drain_s * 1e3 * per_step / appended if appended else 0.0
    result = {
        "variant": args.variant,
        "rows_per_table": rows,
        "total_gib": total / GIB,
        "step_ms": statistics.median(timed) * 1e3,
        "mean_step_ms": statistics.mean(timed) * 1e3,
        # every timed step (the slowest rank's): a disk step's times are bimodal, the eviction
        # steps and the ones their background writes slow far above the rest
        "timed_step_ms": [t * 1e3 for t in timed],
        "warmup_steps": warmup,
        "warmup_ms": statistics.median(times[:warmup]) * 1e3,
        "evicted_rows": sum(c.evictions for c in caches),
        "init_s": init_s,
        "peak_rss_gib": peaks,
        "hit_rate": hit_rate(disk_tables) if disk else None,
        "log_rows": sum(t.file.log_rows for t in disk_tables),
        "appended_rows": appended,
        "logged_rows": logged,
        "drain_s": drain_s,
        "drain_ms_per_step": drain_ms_per_step,
        "mean_with_drains_ms": statistics.mean(timed) * 1e3 + drain_ms_per_step,
        "timed_drains": sum(t.log.drains for t in disk_tables) - sum(drains_before),
        "cpu_step_ms": cpu_ms,  # per rank: mean CPU per timed step, every thread of the process
        "phase_ms_per_step": phase_means(per_rank),
        "timed_phases": per_rank[0],
    }
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    strategy.teardown()


def policy_of(variant: str) -> str:
    """The cache policy of a disk variant ("lru", "lfu", "lrfu", "lru-baseline": LRU on the
    baseline source tree)."""
    return variant.partition(LOG)[0].removesuffix(BASELINE)


BASELINE = job_launch.BASELINE
PIPELINED = "-pipelined"
IN_PLACE = "-inplace"
LOG = "-log"  # then the write log's size in cache sizes, e.g. lru-log10.6: DiskTier(write_log=10.6)


def launch(args: argparse.Namespace, variant: str) -> dict:
    """One fresh 2-process job of `variant` (job_launch.py); its table files deleted after."""
    directory = Path(args.dir) / f"{variant}-{os.getpid()}-{time.monotonic_ns()}"
    options = "disk_gb memory_gb cache_gb tables dim batch ids_per_bag exponent steps warmup"
    options += " max_warmup max_cycle shift_every"
    worker_args = [
        *("--worker", "--variant", variant, "--dir", str(directory)),
        *[f"--{name.replace('_', '-')}={getattr(args, name)}" for name in options.split()],
        *(["--cycle"] if args.cycle else []),
    ]
    source = job_launch.source_of(variant.partition(LOG)[0], args.baseline_src)
    try:
        return job_launch.launch(
            sys.executable, __file__, worker_args, pythonpath=source, timeout=3600
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # the table files: tens of GB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="lru", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    parser.add_argument("--disk-gb", type=float, default=36.0, help="disk tables in total")
    parser.add_argument("--memory-gb", type=float, default=8.0, help="in-memory tables in total")
    parser.add_argument("--cache-gb", type=float, default=2.0, help="cache per process")
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="global batch")
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--exponent", type=float, default=1.05, help="Zipf exponent")
    parser.add_argument(
        "--shift-every",
        type=int,
        default=0,
        help="every this many steps the hot rows move to other rows (0: never): a cache "
        "policy's adaptation to shifting hot rows",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=200,
        help="timed steps: enough for each table to evict a batch (40 timed none at 36 GiB)",
    )
    parser.add_argument("--warmup", type=int, default=20, help="at least these warm-up steps")
    parser.add_argument(
        "--max-warmup", type=int, default=4000, help="at most; disk variants warm until full"
    )
    parser.add_argument(
        "--cycle",
        action="store_true",
        help="on disk: warm up until every write log has drained once, then time until each "
        "has drained once more (at least --steps): a whole log cycle, drains included",
    )
    parser.add_argument("--max-cycle", type=int, default=20000, help="at most, with --cycle")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["memory", "lrfu", "lru"],
        help="lrfu is the default policy; POLICY-baseline (e.g. lrfu-baseline) runs POLICY "
        "from --baseline-src's tree, only the ones named",
    )
    parser.add_argument("--dir", default="runs/disk_tier", help="where the table files go")
    job_launch.add_baseline_src(
        parser, "lru-baseline (LRU from DIR) unless --variants names a -baseline variant"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    try:
        args.variants = job_launch.baseline_variants(
            args.variants, args.baseline_src, "lru" + BASELINE, stem=lambda v: v.partition(LOG)[0]
        )
    except ValueError as error:
        parser.error(str(error))
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for repeat in range(args.repeats):
        order = (
            args.variants[repeat % len(args.variants) :]
            + args.variants[: repeat % len(args.variants)]
        )
        for variant in order:
            result = launch(args, variant)
            runs[variant].append(result)
            print(
                f"repeat {repeat} {variant}: {result['step_ms']:.1f} ms/step (mean "
                f"{result['mean_step_ms']:.1f}, with the log's drains "
                f"{result['mean_with_drains_ms']:.1f}; after {result['warmup_steps']} warm-up), "
                f"peak RSS {max(result['peak_rss_gib']):.2f} GiB, hit rate {result['hit_rate']}, "
                f"{result['logged_rows']} logged rows drained in {result['drain_s']:.2f} s; "
                f"{len(result['timed_step_ms'])} timed steps, {result['timed_drains']} drains, "
                f"CPU {statistics.mean(result['cpu_step_ms']):.1f} ms/step",
                flush=True,
            )
            for rank, phase in enumerate(result["phase_ms_per_step"]):
                if phase:
                    print(
                        f"  rank {rank} per step: "
                        + ", ".join(f"{key} {value:.1f}" for key, value in phase.items() if value),
                        flush=True,
                    )
            if result["hit_rate"] is not None and result["evicted_rows"] == 0:
                print(
                    f"warning: {variant}: rank 0's timed steps evicted no row, so they leave out "
                    "the evictions' cost and may still carry the warm-up's last background "
                    "writes; time more --steps (an eviction batch is a sixteenth of a cache)",
                    flush=True,
                )
    summary = summary_of(runs, args.cache_gb + 1)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=2)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
