"""What a checksum per disk-tier row record would cost: a step's row reads and writes, with and
without one.

The disk tier moves each missed row with its own pread and each evicted dirty row with its own
pwrite (storage/row_file.py). A checksum per record would be computed on every write and checked
on every read. This times, in one process, a step's worth of IO on a row file (`--rows-per-step`
distinct random rows read, as many written), interleaved with and without a vectorized
checksum over the same records (a position-weighted sum of the record's 32-bit words, 8 bytes a
record, which catches overwritten and zeroed bytes), and prints the ratio and the checksum's
milliseconds per step, to set against the disk tier's measured step (docs/benchmarks.md).

    python examples/benchmarks/bench_row_checksum.py --json runs/bench_row_checksum.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_common import write_json

from manualpar.embeddings.storage.row_file import RowFile


def checksums(records: torch.Tensor) -> torch.Tensor:
    """One 64-bit sum per record: its 32-bit words weighted by their position."""
    words = records.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64)
    return words @ weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows-per-step", type=int, default=8_500)  # misses per rank, measured
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        file = RowFile(
            Path(directory) / "t.rows",
            args.rows,
            args.dim,
            torch.float32,
            {"sum": True},
            "bench",
        )
        generator = torch.Generator().manual_seed(0)
        records = file.empty(args.rows_per_step)
        records.view(torch.int32).random_(generator=generator)
        stored = torch.zeros(args.rows, dtype=torch.int64)  # where a format would keep them

        def step(check: bool) -> float:
            rows = torch.randperm(args.rows, generator=generator)[: args.rows_per_step]
            started = time.perf_counter()
            if check:
                stored[rows] = checksums(records)
            file.write(rows, records)
            file.read(rows, records)
            if check and not torch.equal(checksums(records), stored[rows]):
                raise AssertionError("a record changed between its write and its read")
            return time.perf_counter() - started

        times: dict[str, list[float]] = {"plain": [], "checksum": []}
        for _ in range(2):
            step(False), step(True)  # warm the page cache and the allocator
        for repeat in range(args.repeats):
            order = ["plain", "checksum"] if repeat % 2 == 0 else ["checksum", "plain"]
            for name in order:
                runs = [step(name == "checksum") for _ in range(args.steps)]
                times[name].append(statistics.median(runs))
        file.close()
    plain, checked = (statistics.median(times[k]) for k in ("plain", "checksum"))
    extra_ms = (checked - plain) * 1e3
    print(
        f"{args.rows_per_step} rows of {file.record} bytes written and read per step: "
        f"{plain * 1e3:.2f} ms plain, {checked * 1e3:.2f} ms with checksums "
        f"(ratio {checked / plain:.3f}, +{extra_ms:.2f} ms a step)"
    )
    write_json(
        args.json,
        {
            "args": vars(args),
            "record_bytes": file.record,
            "plain_ms": [t * 1e3 for t in times["plain"]],
            "checksum_ms": [t * 1e3 for t in times["checksum"]],
            "ratio": checked / plain,
            "extra_ms_per_step": extra_ms,
        },
    )


if __name__ == "__main__":
    main()
