"""Criteo-format click logs streamed from disk in constant memory: a rank's share read into
batches, a held-out head for validation, and `CriteoStream`, the Trainer's step-addressed data.

Plain or gzip files (told apart by their first bytes). Which lines a rank reads: shares.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from manualpar.data.bad_lines import BadLines
from manualpar.data.criteo_batch import Columns, CriteoBatch
from manualpar.data.criteo_lines import parse_block
from manualpar.data.lines import NEWLINE, READ_BYTES, LinePlace, line_blocks, select_lines
from manualpar.data.shares import Part, Share, rank_share
from manualpar.errors import DataFileError

__all__ = ["CriteoStream", "read_head", "read_share", "share_batches"]


def read_share(
    share: Share, *, read_bytes: int = READ_BYTES, bad_lines: BadLines | None = None
) -> Iterator[Columns]:
    """This share's lines, parsed, in order: blocks of varying size, constant memory.
    Malformed lines raise DataFileError, or are skipped and counted by `bad_lines`."""
    policy = bad_lines if bad_lines is not None else BadLines()
    for part in share.parts:
        yield from _read_part(part, read_bytes, policy)
        policy.check(part.path, end_of_file=True)


def _read_part(part: Part, read_bytes: int, policy: BadLines) -> Iterator[Columns]:
    place = LinePlace(part.path, part.begin, 0 if part.begin == 0 else part.first_line)
    blocks = (
        line_blocks(part.path, read_bytes, begin=part.begin, end=part.end, place=place)
        if part.byte_range
        else line_blocks(part.path, read_bytes, place=place)
    )
    for block, first in blocks:
        numbers = first + np.arange(np.count_nonzero(block == NEWLINE))  # 0-based, in the part
        if part.skip or part.stride > 1:
            kept = numbers - part.skip
            keep = (kept >= 0) & (kept % part.stride == part.offset)
            if not keep.any():
                continue
            if not keep.all():
                block, numbers = select_lines(block, keep), numbers[keep]
        yield parse_block(block, place, numbers + 1, policy)


def share_batches(
    share: Share,
    batch_size: int,
    *,
    epochs: int = 1,
    drop_last: bool = True,
    read_bytes: int = READ_BYTES,
    bad_lines: BadLines | None = None,
) -> Iterator[CriteoBatch]:
    """Batches of `batch_size` of the share's lines in order, `epochs` passes over its parts;
    the last partial batch is dropped unless `drop_last` is false."""
    pending: list[Columns] = []
    count = 0
    for _ in range(epochs):
        for columns in read_share(share, read_bytes=read_bytes, bad_lines=bad_lines):
            pending.append(columns)
            count += len(columns)
            while count >= batch_size:
                merged = Columns.concat(pending)
                yield merged.take(0, batch_size).batch()
                rest = merged.take(batch_size, len(merged))
                pending, count = [rest], len(rest)
    if count and not drop_last:
        yield Columns.concat(pending).batch()


def read_head(
    files: Sequence[str | Path],
    lines: int,
    rank: int,
    world: int,
    bad_lines: BadLines | None = None,
) -> CriteoBatch:
    """Rank `rank`'s share (line i when i % world == rank) of the first `lines` lines of the
    files taken in order (blank and skipped lines included): a validation set. Raises
    DataFileError if the files hold fewer lines."""
    policy = bad_lines if bad_lines is not None else BadLines()
    parts, seen = [], 0
    for path in files:
        place = LinePlace(str(path))
        for block, first in line_blocks(path, place=place):
            order = seen + np.arange(np.count_nonzero(block == NEWLINE))  # across the files
            keep = (order < lines) & (order % world == rank)
            if keep.any():
                numbers = first + 1 + np.flatnonzero(keep)
                parts.append(parse_block(select_lines(block, keep), place, numbers, policy))
            seen = min(int(order[-1]) + 1, lines)
            if seen == lines:
                policy.check(path, end_of_file=True)
                return Columns.concat(parts).batch()
        policy.check(path, end_of_file=True)
    raise DataFileError(
        f"the validation files ({', '.join(str(f) for f in files)}) hold {seen} lines, fewer "
        f"than the {lines} asked for: pass fewer validation samples or other validation files"
    )


class CriteoStream:
    """Criteo files as the Trainer's step-addressed data: `train(step, strategy)` is this rank's
    batch `step` of `batch_size // world` lines of its share (`rank_share`: whole files, or
    byte ranges of plain files when there are fewer files than ranks), `validation` the
    held-out set (`val_files`' first `val_samples` lines; without `val_files`, the first
    `val_samples` lines of the first training file, which training then skips).

    Batch `step` is the same lines on every run with the same files and world size: a resumed
    run (first step k) re-reads its share from the start and drops its first k batches. When a
    rank's share runs out, `train` raises StopIteration and the Trainer stops every rank at that
    step (shares can differ in length). `bad_lines` (default: raise on the first malformed
    line) is shared by training and validation reads; its counts say how many lines this rank
    skipped.
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
        read_bytes: int = READ_BYTES,
    ) -> None:
        if batch_size % world:
            raise DataFileError(
                f"global batch {batch_size} is not a multiple of {world} ranks: pass a batch "
                "size each rank can take an equal part of"
            )
        held_out = 0 if val_files else val_samples
        self.share = rank_share(files, rank, world, skip=held_out)
        self.local_batch, self.epochs, self.read_bytes = batch_size // world, epochs, read_bytes
        self.val_files = tuple(val_files) if val_files else (str(files[0]),)
        self.val_samples, self.rank, self.world = val_samples, rank, world
        self.bad_lines = bad_lines if bad_lines is not None else BadLines()
        self._batches: Iterator[CriteoBatch] | None = None
        self._next = 0
        self._validation: CriteoBatch | None = None

    def train(self, step: int, strategy: object = None) -> CriteoBatch:
        """This rank's batch `step` (`strategy` is unused: the rank was given at construction)."""
        if self._batches is None or step < self._next:
            self._batches = share_batches(
                self.share,
                self.local_batch,
                epochs=self.epochs,
                read_bytes=self.read_bytes,
                bad_lines=self.bad_lines,
            )
            self._next = 0
        while self._next < step:  # resuming: drop the batches trained on before
            next(self._batches)
            self._next += 1
        self._next += 1
        return next(self._batches)

    def validation(self, index: int = 0, strategy: object = None) -> CriteoBatch:
        """This rank's share of the held-out set (one batch; `index` is always 0)."""
        if self._validation is None:
            self._validation = read_head(
                self.val_files, self.val_samples, self.rank, self.world, self.bad_lines
            )
        return self._validation
