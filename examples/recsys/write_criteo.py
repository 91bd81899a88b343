"""Write synthetic samples (data.py's SyntheticCriteo, with its learnable signal) as a
Criteo-format file, for trying the reader (manualpar.data) and the example's `--criteo` runs:

    python examples/recsys/write_criteo.py runs/criteo/day_0.gz --samples 500000
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
from data import SyntheticCriteo, table_rows

from manualpar.data import NUM_DENSE, NUM_SPARSE

RAW_SCATTER = 0x9E3779B1  # odd: id -> id * RAW_SCATTER mod 2**32 is a bijection
WRITE_LINES = 1 << 14


def write_synthetic_criteo(
    path: str | Path,
    samples: int,
    *,
    start: int = 0,
    seed: int = 0,
    max_rows: int = 100_000,
    missing: float = 0.05,
) -> Path:
    """Write samples [start, start + samples) of SyntheticCriteo (its learnable signal) in
    Criteo's format, gzip when `path` ends in .gz. Each table's ids are scattered over 32-bit
    raw values (a bijection per feature, so the per-id signal survives), a `missing` fraction of
    the values is left empty (the same ones for the same arguments), and every 7th sample's I2
    is -1, as Kaggle's data has negative I2s."""
    path = Path(path)
    source = SyntheticCriteo(table_rows(max_rows=max_rows), seed=seed)
    offsets = np.arange(NUM_SPARSE, dtype=np.uint64) * np.uint64(7919)
    with gzip.open(path, "wt") if path.suffix == ".gz" else open(path, "w") as out:
        for begin in range(start, start + samples, WRITE_LINES):
            count = min(WRITE_LINES, start + samples - begin)
            labels, counts, ids = source.raw(begin, count)
            raw = (ids.astype(np.uint64) + offsets) * np.uint64(RAW_SCATTER) % np.uint64(1 << 32)
            counts[(begin + np.arange(count)) % 7 == 3, 1] = -1
            draws = np.random.default_rng([seed, begin]).random((count, NUM_DENSE + NUM_SPARSE))
            gaps = draws < missing
            for row in range(count):
                dense = ("" if gaps[row, j] else str(c) for j, c in enumerate(counts[row]))
                hexes = (
                    "" if gaps[row, NUM_DENSE + j] else f"{v:08x}" for j, v in enumerate(raw[row])
                )
                out.write("\t".join((str(labels[row]), *dense, *hexes)) + "\n")
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="Write synthetic samples (SyntheticCriteo's signal) as a Criteo-format file."
    )
    parser.add_argument("path", help="the file to write; gzip if it ends in .gz")
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--start", type=int, default=0, help="index of the first sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rows", type=int, default=100_000, help="distinct ids per feature")
    args = parser.parse_args()
    print(
        write_synthetic_criteo(
            args.path, args.samples, start=args.start, seed=args.seed, max_rows=args.max_rows
        )
    )
