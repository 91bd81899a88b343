"""Where a disk-tier miss's CPU goes: one rank's tier alone, thread by thread.

    python examples/benchmarks/disk_miss_cost.py --dir runs/disk_tier \
        --json runs/disk_miss_cost.json

One process holds the disk tables of bench_disk_tier.py's small workload as one of `--ranks`
ranks does (4 tables of 2 GiB in all, rows split over the ranks, 0.1 GiB of cache) and drives the
tier alone: each step, each table's ids from each sender (that benchmark's Zipf ids, the ones this
rank owns) are mapped to cache slots (`to_slots`: the bookkeeping, the reads, the evictions) and
released as updated, as a step's backward does; no lookup, update or exchange. It warms up until
every cache has evicted a quarter of its rows and every write log has drained once, then times
whole log cycles (every log drained `--cycles` more times, at least `--steps` steps) and reports
per step: the process's CPU; each phase's (disk_phases.py: the cache's bookkeeping, the fetch,
the evictions' copies and appends, the drain's parts) on the thread that ran it; the training
thread's, the drain thread's, the other live threads' (the reading helpers of both), the threads
that ended (the background writes); and that CPU per missed row. Per-thread CPU comes from /proc
(Linux). Table files go under `--dir`, deleted after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from bench_disk_tier import GIB, zipf_ids
from disk_phases import PhaseClock

import manualpar as mp
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    row_wise,
    shard_embeddings,
)


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each live thread of this process, by its id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = (
                int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9
            )
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--disk-gb", type=float, default=2.0, help="disk tables in total")
    parser.add_argument("--cache-gb", type=float, default=0.1, help="this rank's cache")
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2, help="ranks the rows are split over")
    parser.add_argument("--batch", type=int, default=2048, help="global batch")
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--exponent", type=float, default=1.05, help="Zipf exponent")
    parser.add_argument("--policy", default="lrfu")
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="timed steps, at least")
    parser.add_argument("--cycles", type=int, default=2, help="whole log cycles timed")
    parser.add_argument("--max-warmup", type=int, default=1500)
    parser.add_argument("--dir", default="runs/disk_tier", help="where the table files go")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = int(args.disk_gb * GIB // (args.tables * (args.dim * 4 + 4)))  # a table's rows
    block = -(-rows // args.ranks)  # rank 0's
    tables = [
        EmbeddingBagConfig(f"t{i}", block, args.dim, feature_names=(f"f{i}",))
        for i in range(args.tables)
    ]
    directory = Path(args.dir) / f"miss-cost-{os.getpid()}"
    tier = DiskTier(
        directory,
        cache_bytes=int(args.cache_gb * GIB),
        policy=args.policy,
        io_threads=args.io_threads,
    )
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables, seed=0)
    plan = EmbeddingPlan(1, {t.name: row_wise(on_disk=True) for t in tables})
    emb = shard_embeddings(
        ebc, mp.ManualParallelStrategy(), plan, RowWiseAdagrad(lr=0.01), disk_tier=tier
    )
    # the disk tier's tables (their cache and write log), read by duck type: not public API
    stores: list[Any] = [s for s in emb.storage.stores.values() if hasattr(s, "log")]
    if len(stores) != args.tables:
        raise SystemExit(f"expected {args.tables} disk tables on this rank, found {len(stores)}")
    ids_per_sender = args.batch // args.ranks * args.ids_per_bag

    def batches(step: int) -> list[list[torch.Tensor]]:
        """Each table's ids this rank owns, one tensor per sender."""
        out = []
        for t in range(args.tables):
            ids = [
                zipf_ids(rows, ids_per_sender, 7919 * step + 31 * s + t, args.exponent)
                for s in range(args.ranks)
            ]
            out.append([i[i < block].contiguous() for i in ids])
        return out

    def step(ids: list[list[torch.Tensor]]) -> None:
        for store in stores:
            store.begin_step()
        pinned: list[tuple[Any, torch.Tensor]] = []
        for store, parts in zip(stores, ids, strict=True):
            for part in parts:
                slots = store.to_slots(part)[1]
                if slots is not None:  # None: nothing pinned
                    pinned.append((store, slots))
        for store, slots in pinned:
            store.release(slots, True)

    clock = PhaseClock()
    clock.install()
    count = 0
    try:
        while count < args.max_warmup and not (
            all(s.cache.evictions >= s.cache.capacity // 4 for s in stores)
            and all(s.log.drains >= 1 for s in stores)
        ):
            step(batches(count))
            count += 1
        for store in stores:
            store.cache.hits = store.cache.misses = 0
        drains = [s.log.drains for s in stores]
        drain_threads = {
            t.native_id
            for t in threading.enumerate()
            if t.name.startswith("disk-tier-drain") and t.native_id is not None
        }
        main_id = threading.get_native_id()
        clock.take()
        before, process, timed, made = thread_cpu(), time.process_time(), 0, 0.0
        while timed < args.steps or not all(
            s.log.drains >= d + args.cycles for s, d in zip(stores, drains, strict=True)
        ):
            began = time.thread_time()
            ids = batches(count + timed)
            made += time.thread_time() - began
            step(ids)
            timed += 1
        process = time.process_time() - process - made
        after = thread_cpu()
        phases = clock.take()
    finally:
        for store in stores:
            store.log.settle()
        shutil.rmtree(directory, ignore_errors=True)
    misses = sum(s.cache.misses for s in stores)
    hits = sum(s.cache.hits for s in stores)
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    per_step = 1e3 / timed
    threads = {
        "training": (spent.pop(main_id) - made) * per_step,
        "drain": sum(spent.pop(t, 0.0) for t in drain_threads) * per_step,
        "other_live": sum(spent.values()) * per_step,  # the reading helpers, a write in flight
    }
    threads["ended"] = process * per_step - sum(threads.values())  # the background writes
    result = {
        "args": vars(args),
        "timed_steps": timed,
        "warmup_steps": count,
        "misses_per_step": misses / timed,
        "hit_rate": hits / max(hits + misses, 1),
        "process_cpu_ms": process * per_step,
        "threads_cpu_ms": threads,
        "phases_cpu_ms": {
            key.removeprefix("cpu_"): value * per_step
            for key, value in phases.items()
            if key.startswith("cpu_") and value and key != "cpu_process"
        },
        "us_per_miss": process / max(misses, 1) * 1e6,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
