"""How high a disk-tier cache's hit rate can go on bench_disk_tier.py's ids: the policies the
cache has against two bounds computed offline from the same id stream.

    python examples/benchmarks/disk_hit_bounds.py --steps 1500 --warmup 800 \
        --json runs/disk_hit_bounds.json [--shift-every 100] [--lrfu 64x16 ...]

One table block of rank 0 (the small workload: 2 GiB of 4 tables over 2 ranks, 0.1 GiB of cache,
so 1.03M rows and 97,171 slots), each step's ids from both senders (bench_disk_tier's Zipf ids,
the ones this rank owns), as the tier sees them: one call a sender, a row counted once a call (a
hit if cached, else a miss), the step's rows pinned until it ends. Reported over the steps after
`--warmup`:
- the cache's own policies, run by RowCache itself (row_cache.py: "lru", "lfu", "lrfu", and
  "lrfu" with other reach x uses constants, `--lrfu`);
- `static`: the rows most often used over the whole stream kept, the rest of the slots left
  for a step's other rows: the best any policy can do without knowing the future when ids are
  drawn independently, as here (counted over the stream it is scored on: over a short stream,
  or with `--shift-every` moving the hot rows, it is no bound);
- `belady`: each step's victims the rows used again last (MIN, at step granularity): it knows
  the future, so no policy reaches it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from bench_disk_tier import GIB, zipf_ids

import manualpar.embeddings.storage.row_cache as row_cache
from manualpar.embeddings import DiskTier


def stream(args: argparse.Namespace, rows: int, block: int) -> list[list[np.ndarray]]:
    """Each step's distinct rows of rank 0's block, one array a sender."""
    out = []
    for step in range(args.steps):
        epoch = step // args.shift_every if args.shift_every else 0
        calls = []
        for sender in range(2):
            ids = zipf_ids(rows, 1024 * 20, 7919 * step + 31 * sender, 1.05, epoch).numpy()
            calls.append(np.unique(ids[ids < block]))
        out.append(calls)
    return out


def run_cache(
    steps: list[list[np.ndarray]], block: int, slots: int, policy: str, warmup: int
) -> float:
    cache = row_cache.RowCache(block, slots, policy)
    for step, calls in enumerate(steps):
        if step == warmup:
            cache.hits = cache.misses = 0
        cache.new_step()
        pinned = [cache.assign_ids(torch.from_numpy(ids))[1].slots for ids in calls]
        for slots_of_call in pinned:
            cache.release(slots_of_call, True)
    return cache.hits / (cache.hits + cache.misses)


def static(steps: list[list[np.ndarray]], block: int, slots: int, warmup: int) -> float:
    used = np.zeros(block, np.int64)
    for calls in steps:
        used[np.union1d(*calls)] += 1
    room = int(np.mean([np.union1d(*calls).size for calls in steps]))  # a step's rows
    kept = np.zeros(block, bool)
    kept[np.argpartition(-used, slots - room)[: slots - room]] = True
    hits = misses = 0
    for calls in steps[warmup:]:
        missed = int((~kept[np.union1d(*calls)]).sum())
        misses += missed
        hits += sum(c.size for c in calls) - missed
    return hits / (hits + misses)


def belady(steps: list[list[np.ndarray]], block: int, slots: int, warmup: int) -> float:
    never = len(steps) + 1
    next_use, seen = [], np.full(block, never, np.int64)
    for index in range(len(steps) - 1, -1, -1):
        rows = np.union1d(*steps[index])
        next_use.append((rows, seen[rows].copy()))
        seen[rows] = index
    next_use.reverse()
    cached = np.zeros(block, bool)
    when = np.zeros(block, np.int64)  # a cached row's next use
    held = np.empty(0, np.int64)
    hits = misses = 0
    for index, (rows, after) in enumerate(next_use):
        missing = rows[~cached[rows]]
        if index >= warmup:
            misses += missing.size
            hits += sum(c.size for c in steps[index]) - missing.size
        over = held.size + missing.size - slots
        if over > 0:
            now = np.zeros(block, bool)
            now[rows] = True
            free = held[~now[held]]
            victims = free[np.argpartition(-when[free], over)[:over]]
            cached[victims] = False
            held = held[cached[held]]
        cached[missing] = True
        held = np.concatenate([held, missing])
        when[rows] = after
    return hits / (hits + misses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=800, help="steps before counting")
    parser.add_argument("--shift-every", type=int, default=0, help="as bench_disk_tier's")
    parser.add_argument("--lrfu", nargs="*", default=["64x16"], help="other REACHxUSES")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = int(2 * GIB // (4 * 260))  # a table of the small workload (64 fp32 + a state word)
    block = -(-rows // 2)
    slots = DiskTier(".", cache_bytes=int(0.1 * GIB)).slots(
        {f"t{i}": (block, 260) for i in range(4)}
    )["t0"]
    began = time.perf_counter()
    steps = stream(args, rows, block)
    result: dict[str, float] = {}
    for policy in ("lru", "lfu", "lrfu"):
        result[policy] = run_cache(steps, block, slots, policy, args.warmup)
    defaults = row_cache.LRFU_REACH, row_cache.LRFU_USES
    for pair in args.lrfu:
        row_cache.LRFU_REACH, row_cache.LRFU_USES = (int(v) for v in pair.split("x"))
        result[f"lrfu{pair}"] = run_cache(steps, block, slots, "lrfu", args.warmup)
    row_cache.LRFU_REACH, row_cache.LRFU_USES = defaults
    result["static"] = static(steps, block, slots, args.warmup)
    result["belady"] = belady(steps, block, slots, args.warmup)
    report = {
        "args": vars(args),
        "block_rows": block,
        "slots": slots,
        "hit_rate": result,
        "seconds": time.perf_counter() - began,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
