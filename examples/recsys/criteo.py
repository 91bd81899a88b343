"""Criteo-format click logs streamed from disk: a constant-memory reader, each rank's share of the
files, and a writer of small synthetic files with a learnable signal.

The format (Criteo Kaggle display advertising `train.txt`, Criteo Terabyte `day_0` ... `day_23`),
one sample per line, tab-separated, plain or gzip:

    label \\t I1 ... I13 \\t C1 ... C26

label 0 or 1; I1..I13 integers (empty when missing; Kaggle has negative ones); C1..C26 hex
strings of up to 8 digits (empty when missing). A batch holds dense (B, 13) float32
log(1 + max(count, 0)) with missing counts as 0 (DLRM's transform), the 26 categorical values as
raw int64 ids (the hex value; a missing value is MISSING_ID) and the labels.

Lines are parsed a block at a time with numpy (no Python loop over lines or fields): the block's
tabs and newlines give every field's start and length, and each field's last 8 bytes, loaded as
one uint64, are decoded with bit arithmetic for all fields at once (`criteo_lines.decode_numbers`).
"""

from __future__ import annotations

import dataclasses
import gzip
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from criteo_lines import (
    CR,
    MAX_HEX_DIGITS,
    MAX_INT_DIGITS,
    MAX_LINE_BYTES,
    MINUS,
    NEWLINE,
    READ_BYTES,
    TAB,
    ZERO,
    BadLines,
    CriteoFormatError,
    decode_numbers,
    drop_blank_lines,
    excerpt,
    line_blocks,
    select_lines,
)
from data import NUM_DENSE, NUM_SPARSE, Batch, SyntheticCriteo, log_counts, make_batch, table_rows

from manualpar import HashIds, ManagedCollisions
from manualpar.embeddings import EmbeddingBagConfig

__all__ = [
    "MAX_LINE_BYTES",
    "MISSING_ID",
    "READ_BYTES",
    "BadLines",
    "Columns",
    "CriteoFormatError",
    "CriteoStream",
    "batches",
    "concat",
    "head",
    "rank_share",
    "read_share",
    "write_synthetic_criteo",
]

FIELDS = 1 + NUM_DENSE + NUM_SPARSE
FIELD_NAMES = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))
MISSING_ID = 1 << 32  # one past the largest 8-digit hex value: never a real value's id


@dataclass(frozen=True)
class Columns:
    """Parsed lines: labels (n,) int64 0/1, dense (n, 13) float32 log counts, ids (n, 26) int64."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, start: int, stop: int) -> Columns:
        return Columns(self.labels[start:stop], self.dense[start:stop], self.ids[start:stop])

    def batch(self) -> Batch:
        return make_batch(self.labels, self.dense, self.ids)


def concat(parts: Sequence[Columns]) -> Columns:
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return Columns(empty, np.zeros((0, NUM_DENSE), np.float32), empty.reshape(0, NUM_SPARSE))
    if len(parts) == 1:
        return parts[0]
    return Columns(
        np.concatenate([p.labels for p in parts]),
        np.concatenate([p.dense for p in parts]),
        np.concatenate([p.ids for p in parts]),
    )


# ---- parsing -------------------------------------------------------------------------------
def parse_block(
    block: np.ndarray,
    path: str | Path,
    line_numbers: np.ndarray,
    bad_lines: BadLines | None = None,
) -> Columns:
    """Parse whole lines (uint8, each ending in a newline); blank lines are dropped.
    `line_numbers` are their 1-based numbers in `path`, for messages. A malformed line raises
    CriteoFormatError naming it, or, if `bad_lines` skips, is counted and left out."""
    policy = bad_lines if bad_lines is not None else BadLines()
    block, line_numbers = drop_blank_lines(block, line_numbers)
    policy.lines += len(line_numbers)
    block, line_numbers, separators = _whole_records(block, path, line_numbers, policy)
    if not len(line_numbers):
        return concat([])
    ends = separators.reshape(len(line_numbers), FIELDS)
    starts = np.empty_like(ends)
    starts[0, 0] = 0
    starts[1:, 0] = ends[:-1, -1] + 1
    starts[:, 1:] = ends[:, :-1] + 1
    crlf = (ends[:, -1] > starts[:, -1]) & (block[ends[:, -1] - 1] == CR)
    ends[:, -1] -= crlf  # Windows line ends
    lengths = ends - starts

    label_bytes = block[starts[:, 0]]
    bad_label = (lengths[:, 0] != 1) | ((label_bytes != ZERO) & (label_bytes != ZERO + 1))
    labels = label_bytes.astype(np.int64) - ZERO
    padded = np.concatenate([np.full(8, ZERO, dtype=np.uint8), block])  # for decode_numbers' loads
    dense_starts, dense_lengths = starts[:, 1 : 1 + NUM_DENSE], lengths[:, 1 : 1 + NUM_DENSE]
    negative = (dense_lengths > 0) & (block[dense_starts] == MINUS)
    dense_ends = ends[:, 1 : 1 + NUM_DENSE]
    counts, bad_dense = decode_numbers(
        padded, dense_ends, dense_lengths - negative, hexadecimal=False
    )
    bad_dense |= negative & (dense_lengths == 1)  # a lone "-"
    counts = np.where(negative, -counts, counts)
    sparse_lengths = lengths[:, 1 + NUM_DENSE :]
    ids, bad_sparse = decode_numbers(
        padded, ends[:, 1 + NUM_DENSE :], sparse_lengths, hexadecimal=True
    )
    ids[sparse_lengths == 0] = MISSING_ID

    bad = np.concatenate([bad_label[:, None], bad_dense, bad_sparse], axis=1)
    if bad.any():
        rows = bad.any(axis=1)
        line = int(np.flatnonzero(rows)[0])
        field = int(np.flatnonzero(bad[line])[0])
        start = int(starts[line, field])
        text = bytes(block[start : start + lengths[line, field]]).decode("utf-8", "replace")
        policy.bad(
            int(rows.sum()),
            f"{path}, line {line_numbers[line]}: field {field + 1} ({FIELD_NAMES[field]}) "
            f"is {excerpt(text)!r}, not {_EXPECTED[min(field, 1) + (field > NUM_DENSE)]}",
        )
        keep = ~rows
        labels, counts, ids = labels[keep], counts[keep], ids[keep]
    policy.check(path)
    return Columns(labels, log_counts(counts), ids)


_EXPECTED = (  # what a field should be, by kind: label (0), integers (1 to 13), hex (14 to 39)
    "a label (0 or 1)",
    f"an integer (up to {MAX_INT_DIGITS} digits, optional '-') or empty",
    f"a hex string (1 to {MAX_HEX_DIGITS} digits) or empty",
)


def _whole_records(
    block: np.ndarray, path: str | Path, line_numbers: np.ndarray, policy: BadLines
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block's lines with exactly FIELDS fields (a line with another count raises, or is
    skipped by `policy`), their numbers, and the positions of their tabs and newlines."""
    is_newline = block == NEWLINE
    separators = np.flatnonzero(is_newline | (block == TAB))
    if separators.size == FIELDS * len(line_numbers) and bool(
        (block[separators[FIELDS - 1 :: FIELDS]] == NEWLINE).all()
    ):
        return block, line_numbers, separators
    tabs = np.diff(np.cumsum(block == TAB)[np.flatnonzero(is_newline)], prepend=0)
    wrong = tabs != FIELDS - 1
    bad = int(np.flatnonzero(wrong)[0])
    policy.bad(
        int(wrong.sum()),
        f"{path}, line {line_numbers[bad]}: expected {FIELDS} tab-separated fields (label, "
        f"{NUM_DENSE} integers, {NUM_SPARSE} hex strings), got {int(tabs[bad]) + 1}",
    )
    block = select_lines(block, ~wrong)
    return block, line_numbers[~wrong], np.flatnonzero((block == NEWLINE) | (block == TAB))


# ---- each rank's share ---------------------------------------------------------------------
@dataclass(frozen=True)
class Share:
    """What one rank reads: `files`, and of their lines (numbered across them from 0, after the
    first `skip` lines of the first file) those with number % `stride` == `offset`."""

    files: tuple[str, ...]
    stride: int = 1
    offset: int = 0
    skip: int = 0


def rank_share(files: Sequence[str | Path], rank: int, world: int, *, skip: int = 0) -> Share:
    """Rank `rank`'s share: whole files (file j to rank j % world) when there are at least as many
    files as ranks, else every rank reads every file and keeps line i when i % world == rank.
    `skip` lines at the head of the first file (a held-out validation set) belong to nobody."""
    names = tuple(str(f) for f in files)
    if not names:
        raise ValueError("no Criteo files given")
    if len(names) >= world:
        mine = names[rank::world]
        return Share(mine, skip=skip if rank == 0 else 0)
    return Share(names, stride=world, offset=rank, skip=skip)


def read_share(
    share: Share, *, read_bytes: int = READ_BYTES, bad_lines: BadLines | None = None
) -> Iterator[Columns]:
    """This share's lines, parsed, in file order: blocks of varying size, constant memory.
    Malformed lines raise, or are skipped and counted by `bad_lines` (see BadLines)."""
    policy = bad_lines if bad_lines is not None else BadLines()
    index = 0  # the next line's number in the share's stream (the skipped head not counted)
    for number, path in enumerate(share.files):
        skip = share.skip if number == 0 else 0
        for block, first in line_blocks(path, read_bytes):
            numbers = first + np.arange(np.count_nonzero(block == NEWLINE))  # 0-based, in file
            counted = numbers >= skip
            keep = counted & ((index + np.cumsum(counted) - 1) % share.stride == share.offset)
            index += int(np.count_nonzero(counted))
            if not keep.any():
                continue
            if not keep.all():
                block = select_lines(block, keep)
            yield parse_block(block, path, numbers[keep] + 1, policy)
        policy.check(path, end_of_file=True)


def batches(
    share: Share,
    batch_size: int,
    *,
    epochs: int = 1,
    drop_last: bool = True,
    bad_lines: BadLines | None = None,
) -> Iterator[Batch]:
    """Batches of `batch_size` of the share's lines in order, `epochs` passes over the files; the
    last partial batch is dropped unless `drop_last` is false."""
    pending: list[Columns] = []
    count = 0
    for _ in range(epochs):
        for columns in read_share(share, bad_lines=bad_lines):
            pending.append(columns)
            count += len(columns)
            while count >= batch_size:
                merged = concat(pending)
                yield merged.take(0, batch_size).batch()
                rest = merged.take(batch_size, len(merged))
                pending, count = [rest], len(rest)
    if count and not drop_last:
        yield concat(pending).batch()


def head(
    files: Sequence[str | Path],
    lines: int,
    rank: int,
    world: int,
    bad_lines: BadLines | None = None,
) -> Batch:
    """Rank `rank`'s share (line i when i % world == rank) of the first `lines` lines of the
    files taken in order (blank and skipped lines included): a validation set. Raises if the
    files hold fewer lines."""
    policy = bad_lines if bad_lines is not None else BadLines()
    parts, seen = [], 0
    for path in files:
        for block, first in line_blocks(path):
            order = seen + np.arange(np.count_nonzero(block == NEWLINE))  # across the files
            keep = (order < lines) & (order % world == rank)
            if keep.any():
                numbers = first + 1 + np.flatnonzero(keep)
                parts.append(parse_block(select_lines(block, keep), path, numbers, policy))
            seen = min(int(order[-1]) + 1, lines)
            if seen == lines:
                policy.check(path, end_of_file=True)
                return concat(parts).batch()
        policy.check(path, end_of_file=True)
    raise ValueError(
        f"the validation files ({', '.join(str(f) for f in files)}) hold {seen} lines, fewer "
        f"than the {lines} asked for: pass fewer validation samples or other validation files"
    )


RAW_ID_MODES = ("hash", "lru", "lfu")


def raw_id_tables(
    tables: Sequence[EmbeddingBagConfig], mode: str = "hash"
) -> list[EmbeddingBagConfig]:
    """The tables reading raw ids (hex values, MISSING_ID): hashed into rows (`mode` "hash") or
    given rows by managed collisions evicting the least recently ("lru") or least often ("lfu")
    seen id; salt = the table's position, so each feature's ids land independently."""
    if mode not in RAW_ID_MODES:
        raise ValueError(f"raw-id mode must be one of {RAW_ID_MODES}, got {mode!r}")
    return [
        dataclasses.replace(
            table,
            raw_ids=HashIds(salt=index)
            if mode == "hash"
            else ManagedCollisions(policy=mode, salt=index),
        )
        for index, table in enumerate(tables)
    ]


def hashed_tables(tables: Sequence[EmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    """`raw_id_tables(tables, "hash")`."""
    return raw_id_tables(tables, "hash")


class CriteoStream:
    """Criteo files as the Trainer's step-addressed data: `train(step, strategy)` is this rank's
    next batch of `batch_size // world` lines of its share (rank_share), `validation` the held-out
    set (`val_files`' first `val_samples` lines; without `val_files`, the first `val_samples`
    lines of the first training file, which training then skips).

    Reading is sequential: a resumed run (first step k) re-reads and drops its first k batches.
    When a rank's share runs out, `train` raises StopIteration and the Trainer stops every rank
    at that step (shares of whole files can differ in length). `bad_lines` (default: raise on
    the first malformed line) is shared by training and validation reads; its counts say how
    many lines this rank skipped.
    """

    def __init__(
        self,
        files: Sequence[str | Path],
        *,
        rank: int,
        world: int,
        batch_size: int,
        val_samples: int,
        val_files: Sequence[str | Path] = (),
        epochs: int = 1,
        bad_lines: BadLines | None = None,
    ) -> None:
        if batch_size % world:
            raise ValueError(f"global batch {batch_size} is not a multiple of {world} ranks")
        held_out = 0 if val_files else val_samples
        self.share = rank_share(files, rank, world, skip=held_out)
        self.local_batch, self.epochs = batch_size // world, epochs
        self.val_files = tuple(val_files) if val_files else (str(files[0]),)
        self.val_samples, self.rank, self.world = val_samples, rank, world
        self.bad_lines = bad_lines if bad_lines is not None else BadLines()
        self._batches: Iterator[Batch] | None = None
        self._next = 0
        self._validation: Batch | None = None

    def train(self, step: int, strategy: object = None) -> Batch:
        """This rank's batch `step` (`strategy` is unused: the rank was given at construction)."""
        if self._batches is None or step < self._next:
            self._batches = batches(
                self.share, self.local_batch, epochs=self.epochs, bad_lines=self.bad_lines
            )
            self._next = 0
        while self._next < step:  # resuming: drop the batches trained on before
            next(self._batches)
            self._next += 1
        self._next += 1
        return next(self._batches)

    def validation(self, index: int = 0, strategy: object = None) -> Batch:
        if self._validation is None:
            self._validation = head(
                self.val_files, self.val_samples, self.rank, self.world, self.bad_lines
            )
        return self._validation


# ---- synthetic files -----------------------------------------------------------------------
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
            gaps = np.random.default_rng([seed, begin]).random((count, FIELDS - 1)) < missing
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
