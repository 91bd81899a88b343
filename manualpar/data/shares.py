"""Each rank's share of a set of line files: which files, which bytes, which lines.

- At least as many files as ranks: whole files, file j to rank j % world.
- Fewer files than ranks: each plain file is cut into `world` byte ranges (byte_ranges.py) and
  rank r reads range r of every file, about 1/world of its bytes. A gzip file cannot be entered
  in the middle: every rank decompresses it and keeps its lines i with i % world == rank. Give
  at least as many gzip files as ranks, or decompress them, for each rank to read only its part.

The first `skip` lines of the first file (a held-out validation set) belong to nobody. The
shares depend only on the file names, their order and sizes, and the rank and world size, so a
restarted run with the same files gets the same shares.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from manualpar.data.byte_ranges import byte_ranges, offset_after_lines
from manualpar.data.lines import is_gzip
from manualpar.errors import DataFileError

__all__ = ["Part", "Share", "rank_share"]


@dataclass(frozen=True)
class Part:
    """What a rank reads of one file: the lines starting in bytes [begin, end) (`end` None: to
    the end of the file), after the first `skip` of them, and of the rest (numbered from 0)
    those with number % `stride` == `offset`. `first_line` is the number of lines before
    `begin` when known (else counted if a message needs it)."""

    path: str
    begin: int = 0
    end: int | None = None
    stride: int = 1
    offset: int = 0
    skip: int = 0
    first_line: int | None = None

    @property
    def byte_range(self) -> bool:
        """Whether this part is a byte range of the file rather than all of it."""
        return self.begin > 0 or self.end is not None


@dataclass(frozen=True)
class Share:
    """What one rank reads: its parts, in order."""

    parts: tuple[Part, ...]

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(part.path for part in self.parts)


def rank_share(files: Sequence[str | Path], rank: int, world: int, *, skip: int = 0) -> Share:
    """Rank `rank`'s share of `files` among `world` ranks (see the module docstring); the
    first `skip` lines of the first file are held out of every share."""
    names = tuple(str(f) for f in files)
    if not names:
        raise DataFileError("no data files given: pass at least one file")
    if not 0 <= rank < world:
        raise DataFileError(f"rank {rank} is not one of the {world} ranks")
    if len(names) >= world:
        return Share(
            tuple(Part(p, skip=skip if i == 0 else 0) for i, p in enumerate(names))[rank::world]
        )
    return Share(
        tuple(_part(path, rank, world, skip if i == 0 else 0) for i, path in enumerate(names))
    )


def _part(path: str, rank: int, world: int, skip: int) -> Part:
    """This rank's part of a file every rank reads a part of."""
    if is_gzip(path):
        return Part(path, stride=world, offset=rank, skip=skip)
    start = offset_after_lines(path, skip) if skip else 0
    begin, end = byte_ranges(os.path.getsize(path), world, start)[rank]
    return Part(path, begin=begin, end=end, first_line=skip if rank == 0 else None)
