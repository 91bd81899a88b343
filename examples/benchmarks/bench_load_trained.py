"""Loading a trained model whose table lives on disk: `load_trained` against reading the
checkpoint's bytes.

    python examples/benchmarks/bench_load_trained.py --gb 1 --repeats 3 --dir runs/load_trained \
        --json runs/bench_load_trained.json

One process saves a checkpoint of a collection holding one disk table of about `--gb` GB (64
float32 columns, row-wise Adagrad; the optimizer state saved beside it), then, `--repeats`
times in alternating order: (a) reads every file of the checkpoint (64 MiB reads: the
baseline, what any load must at least do), (b) `mp.load_trained` of the model into a fresh disk
tier (its file reserved anew each time), (c) a copy of the checkpoint's bytes into a freshly
reserved file (8 MiB reads, each written with pwrite): what a load that writes every byte of
the table must at least do. The page cache cannot be dropped without privileges, so the first
repeat's read is as cold as this machine allows (the checkpoint was just written: it may still
be cached) and the later ones are warm; both are reported. Reported: the medians of the
per-repeat ratios load_trained / read (target: at most 1.5x) and load_trained / copy, and each
time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import time
from pathlib import Path

from bench_common import environment_info, median, peak_rss_gb, write_json

import manualpar as mp
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    row_wise,
    shard_embeddings,
)

DIM = 64
ROW_BYTES = DIM * 4 + 4  # the weights and the row-wise sum


class Scorer(mp.ParallelModule):
    def __init__(self, rows: int, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self.sparse: EmbeddingBagCollection | ShardedEmbeddingBagCollection = (
            EmbeddingBagCollection([EmbeddingBagConfig("big", rows, DIM)], seed=3)
        )

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        plan = EmbeddingPlan(strategy.world_size, {"big": row_wise(on_disk=True)})
        tier = DiskTier(self.directory, cache_rows=4096)
        assert isinstance(self.sparse, EmbeddingBagCollection)  # (setup runs once)
        self.sparse = shard_embeddings(
            self.sparse, strategy, plan, RowWiseAdagrad(lr=0.1), disk_tier=tier
        )


def read_bytes(path: Path) -> int:
    total = 0
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb", buffering=0) as stream:
            while chunk := stream.read(64 * 2**20):
                total += len(chunk)
    return total


def copy_bytes(path: Path, into: Path) -> int:
    """Every file of `path` copied into one new file reserved up front, as a disk tier's is."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    total = sum(file.stat().st_size for file in files)
    into.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(into, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(total, 1))
        buffer, at = bytearray(8 * 2**20), 0
        for file in files:
            with open(file, "rb", buffering=0) as stream:
                while got := stream.readinto(buffer):
                    at += os.pwrite(fd, memoryview(buffer)[:got], at)
    finally:
        os.close(fd)
    into.unlink()
    return at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="the table's size on disk")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="runs/load_trained")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    rows = int(args.gb * 1e9 // ROW_BYTES)
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        model = Scorer(rows, root / "saved_tables")
    model.setup(strategy)
    started = time.perf_counter()
    checkpoint = root / "ckpt"
    strategy.save_checkpoint(checkpoint, {"model": model, "sparse": model.sparse.fused_optimizer})
    save_s = time.perf_counter() - started
    del model
    shutil.rmtree(root / "saved_tables")
    times: dict[str, list[float]] = {"read": [], "load_trained": [], "copy": []}
    size = 0
    for repeat in range(args.repeats):
        order = list(times) if repeat % 2 == 0 else list(reversed(times))
        for name in order:
            started = time.perf_counter()
            if name == "read":
                size = read_bytes(checkpoint)
            elif name == "copy":
                copy_bytes(checkpoint, root / f"copy_{repeat}")
            else:
                tables = root / f"tables_{repeat}"  # the last one's may not be closed yet
                build = functools.partial(Scorer, rows, tables)
                mp.load_trained(build, strategy, checkpoint)
            times[name].append(time.perf_counter() - started)
            if name == "load_trained":
                gc.collect()  # the model goes, its file with it
                shutil.rmtree(tables)
    ratios = [t / r for t, r in zip(times["load_trained"], times["read"], strict=True)]
    to_copy = [t / c for t, c in zip(times["load_trained"], times["copy"], strict=True)]
    print(
        f"checkpoint {size / 1e9:.2f} GB (saved in {save_s:.1f} s): read "
        + ", ".join(f"{t:.2f}" for t in times["read"])
        + " s; load_trained "
        + ", ".join(f"{t:.2f}" for t in times["load_trained"])
        + f" s; ratio median {median(ratios):.2f}x (per repeat: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + "); copy "
        + ", ".join(f"{t:.2f}" for t in times["copy"])
        + f" s; load_trained / copy median {median(to_copy):.2f}x",
        flush=True,
    )
    write_json(
        args.json,
        {
            "benchmark": "load_trained",
            "checkpoint_bytes": size,
            "rows": rows,
            "read_s": times["read"],
            "load_trained_s": times["load_trained"],
            "ratios": ratios,
            "median_ratio": median(ratios),
            "copy_s": times["copy"],
            "ratios_to_copy": to_copy,
            "median_ratio_to_copy": median(to_copy),
            "peak_rss_gb": peak_rss_gb(),
            "environment": environment_info(strategy),
        },
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
