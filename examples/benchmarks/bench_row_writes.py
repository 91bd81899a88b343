"""Where the disk tier's writes go: a step's evicted rows written one record at a time, on the
tables' file system, on a memory file system, and as one sequential write.

The disk tier writes each evicted dirty row at its own offset with its own pwrite (storage/
row_file.py, kernels/csrc/row_io.cpp), in the background. This times, in one process, the same
`--rows-per-step` records written three ways, interleaved in rotating order, `--repeats` times:

- scattered: at random rows of a row file in `--dir` (the disk tier's writes);
- scattered-memory: the same on a memory file system (`--memory-dir`, default /dev/shm), where
  no journal or block mapping is kept: what the system call and the copy cost alone;
- sequential: the same bytes as one write of consecutive rows in `--dir`, as a log-structured
  layout (rows appended in eviction order, an index of where each row lives) would issue.

Each row file is written whole and synced first, so every write lands on a clean page in the
page cache (no device read): the numbers are CPU, not device, time. Prints microseconds per row
and each way's ratio to the scattered one, and writes JSON:

    python examples/benchmarks/bench_row_writes.py --json runs/bench_row_writes.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_common import write_json

from manualpar.embeddings.storage.row_file import RowFile

WAYS = ("scattered", "scattered-memory", "sequential")


def filled_file(directory: str, rows: int, dim: int) -> RowFile:
    """A row file of `rows` rows, each written once and synced: its pages in the page cache and
    clean, as in a disk tier's steady state, where the files are larger than the share of
    memory the kernel lets stay dirty (a write to a page already dirty costs less)."""
    file = RowFile(Path(directory) / "t.rows", rows, dim, torch.float32, {"sum": True}, "bench")
    chunk = 65_536
    for start in range(0, rows, chunk):
        file.write_range(start, file.empty(min(chunk, rows - start)))
    os.fsync(file.fd)
    return file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows per file")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows-per-step", type=int, default=6_000)  # dirty victims, measured
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="the tables' file system (default: tmp)")
    parser.add_argument("--memory-dir", default="/dev/shm")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as on_disk,
        tempfile.TemporaryDirectory(dir=args.memory_dir) as in_memory,
    ):
        files = {"disk": filled_file(on_disk, args.rows, args.dim)}
        files["memory"] = filled_file(in_memory, args.rows, args.dim)
        records = files["disk"].empty(args.rows_per_step)
        records.view(torch.int32).random_(generator=generator)
        log_end = [0]  # the sequential way appends where it left off, wrapping at the end

        def step(way: str) -> float:
            rows = torch.randperm(args.rows, generator=generator)[: args.rows_per_step]
            rows = rows.sort().values  # as BackgroundWrites submits them
            started = time.perf_counter()
            if way == "sequential":
                if log_end[0] + args.rows_per_step > args.rows:
                    log_end[0] = 0
                files["disk"].write_range(log_end[0], records)
                log_end[0] += args.rows_per_step
            else:
                files["memory" if way == "scattered-memory" else "disk"].write(rows, records)
            return time.perf_counter() - started

        for way in WAYS:  # warm the allocator and the code paths
            step(way)
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for repeat in range(args.repeats):
            order = WAYS[repeat % len(WAYS) :] + WAYS[: repeat % len(WAYS)]
            for way in order:
                times[way].append(statistics.median(step(way) for _ in range(args.steps)))
        record = files["disk"].record
        for file in files.values():
            file.close()
    per_row = {way: statistics.median(t) / args.rows_per_step * 1e6 for way, t in times.items()}
    ratios = {
        way: statistics.median(a / b for a, b in zip(times[way], times["scattered"], strict=True))
        for way in WAYS
    }
    for way in WAYS:
        print(
            f"{way:17s} {per_row[way]:7.3f} us a row  x{ratios[way]:.3f} of scattered "
            f"({args.rows_per_step} rows of {record} bytes a step)",
            flush=True,
        )
    write_json(
        args.json,
        {
            "args": vars(args),
            "record_bytes": record,
            "ms_per_step": {way: [t * 1e3 for t in times[way]] for way in WAYS},
            "us_per_row": per_row,
            "ratio_to_scattered": ratios,
        },
    )


if __name__ == "__main__":
    main()
