"""The recommender's Criteo reader against its training step: is reading ever the bottleneck?

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_criteo_reader.py --json runs/bench_criteo_reader.json

Rank 0 writes `--lines` synthetic samples in Criteo's format (examples/recsys/write_criteo.py),
plain and gzip, unless `--files PLAIN GZIP` names real ones. Every repeat then measures, in a
rotating order, on every rank at once (the processes share the machine as in training):

- the reader (manualpar.data), in samples per second per process: a whole pass over the plain
  and the gzip file through `share_batches()`, batches built (CriteoBatch, SparseFeatures); "all
  lines" is what a rank does when it reads whole files (at least as many files as ranks),
  "1/world" its share of one file among all ranks (fewer files than ranks): a byte range of
  the plain file, every world-th line of the gzip one (which every rank decompresses whole);
- the example's training step (DLRM, 26 HashIds tables, row-wise Adagrad, Adam on the MLPs) on
  batches read beforehand, in samples per second per process: local batch / the slowest rank's
  step time, median of `--steps` after `--warmup`;
- the same step reading each batch from the plain file as it goes: inline (the loop calls the
  reader between steps) and read ahead (`ReadAhead`: the next batch parsed in a background
  thread during the step). What each adds to the step is its rate against the pre-read one.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import environment_info, median, time_steps, write_json

import manualpar as mp
from manualpar.data import CriteoStream, rank_share, share_batches

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recsys"))  # the example
from data import hashed_tables, make_tables, table_rows
from model import DLRM
from write_criteo import write_synthetic_criteo


def read_rate(path: str, rank: int, stride: int, local_batch: int) -> float:
    """Samples per second of one pass over `path` into batches (this rank's share of `stride`)."""
    share = rank_share([path], rank if stride > 1 else 0, stride)
    started = time.perf_counter()
    samples = sum(len(batch) for batch in share_batches(share, local_batch, drop_last=False))
    return samples / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--lines", type=int, default=300_000, help="synthetic lines to write (without --files)")
    add("--files", nargs=2, metavar=("PLAIN", "GZIP"), help="read these instead")
    add("--data-dir", default="runs/bench-criteo-data", help="where the synthetic files go")
    add("--batch", type=int, default=2048, help="global batch (all ranks)")
    add("--dim", type=int, default=16)
    add("--max-rows", type=int, default=100_000, help="cap on rows per table")
    add("--steps", type=int, default=20)
    add("--warmup", type=int, default=3)
    add("--repeats", type=int, default=5)
    add("--json", default=None)
    args = parser.parse_args()
    strategy = mp.ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    if args.files:
        plain, packed = args.files
    else:
        folder = Path(args.data_dir)
        plain, packed = str(folder / "day.tsv"), str(folder / "day.tsv.gz")
        if strategy.is_global_zero:
            folder.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            for path in (plain, packed):
                write_synthetic_criteo(path, args.lines)
            print(f"wrote {args.lines:,} lines twice in {time.perf_counter() - started:.0f} s")
        strategy.barrier()
    local_batch = args.batch // world
    rows = table_rows("kaggle", args.max_rows)
    with mp.empty_init():
        model = DLRM(hashed_tables(make_tables(rows, args.dim)), top=[128, 64])
    model.setup(strategy)
    optimizer = model.configure_optimizers()
    stream = CriteoStream([plain], rank=rank, world=world, batch_size=args.batch, val_samples=0)
    ready = [stream.train(step) for step in range(8)]
    counter = iter(range(10**9))

    def train_step() -> None:
        batch = ready[next(counter) % len(ready)]
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def train_rate() -> float:
        return local_batch / median(time_steps(strategy, train_step, args.steps, args.warmup))

    def streamed_rate(ahead: bool) -> float:
        """The step on batches read from the file as it goes (a fresh stream each time)."""
        fresh = CriteoStream(
            [plain], rank=rank, world=world, batch_size=args.batch, val_samples=0, epochs=10**6
        )
        data = mp.ReadAhead(fresh.train) if ahead else fresh.train
        indices = iter(range(10**9))

        def step() -> None:
            batch = data(next(indices), strategy)
            loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        try:
            return local_batch / median(time_steps(strategy, step, args.steps, args.warmup))
        finally:
            if isinstance(data, mp.ReadAhead):
                data.close()

    variants: dict[str, Callable[[], float]] = {
        "read plain, all lines": lambda: read_rate(plain, rank, 1, local_batch),
        "read gzip, all lines": lambda: read_rate(packed, rank, 1, local_batch),
        "read plain, 1/world bytes": lambda: read_rate(plain, rank, world, local_batch),
        "read gzip, 1/world lines": lambda: read_rate(packed, rank, world, local_batch),
        "train, reading inline": lambda: streamed_rate(ahead=False),
        "train, read ahead": lambda: streamed_rate(ahead=True),
        "train": train_rate,
    }
    if world == 1:
        del variants["read plain, 1/world bytes"], variants["read gzip, 1/world lines"]
    rates: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            strategy.barrier()
            rate = torch.tensor(variants[name](), dtype=torch.float64)
            rates[name].append(float(strategy.all_reduce(rate, op="min").item()))  # slowest rank
    train = median(rates["train"])
    results = {}
    for name, values in rates.items():
        results[name] = {"samples_per_s": values, "median": median(values)}
        if name.startswith("read "):
            results[name]["read_cost_per_step"] = train / median(values)
        elif name != "train":
            results[name]["step_time_vs_pre_read"] = train / median(values)
    if strategy.is_global_zero:
        print(f"{world} processes, local batch {local_batch}, {torch.get_num_threads()} threads")
        print(f"train                       {train:12,.0f} samples/s per process")
        for name in names[:-1]:
            value = median(rates[name])
            if name.startswith("train, "):
                print(
                    f"{name:27s} {value:12,.0f} samples/s per process: the step takes "
                    f"{train / value:.3f}x the step on pre-read batches",
                    flush=True,
                )
                continue
            cost = train / value
            print(
                f"{name:27s} {value:12,.0f} samples/s per process: reading adds {cost:.2f}x a "
                f"step's time{' (reading is the bottleneck)' if cost > 1 else ''}",
                flush=True,
            )
        write_json(
            args.json,
            {
                "benchmark": "bench_criteo_reader",
                "config": vars(args),
                "environment": environment_info(strategy),
                "results": results,
            },
        )
    strategy.teardown()


if __name__ == "__main__":
    main()
