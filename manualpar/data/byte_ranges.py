"""A plain text file shared by byte ranges: N ranks each read about 1/N of its bytes, and the
ranges' lines together are every line of the file exactly once.

`byte_ranges` cuts the bytes at equal offsets. A range's lines are those that start inside it:
reading begins at the first line start at or after its offset (a position is a line start when
it is the first byte of the file or follows a newline) and ends with the line that spans the
next range's offset. A range in which no line starts (a long line covers it, or there are more
ranks than lines) holds no line. A gzip stream cannot be entered in the middle, so only plain
files are cut this way.
"""

from __future__ import annotations

import io
import itertools
from pathlib import Path

from manualpar.errors import DataFileError

__all__ = [
    "ALIGN_BYTES",
    "SCAN_BYTES",
    "byte_ranges",
    "line_start",
    "lines_before",
    "offset_after_lines",
]

SCAN_BYTES = 1 << 16  # read at a time when counting lines
ALIGN_BYTES = 1 << 12  # read at a time looking for a range's first line: a few lines' worth


def byte_ranges(size: int, parts: int, start: int = 0) -> list[tuple[int, int]]:
    """`parts` (begin, end) offsets cutting bytes [start, size) into equal ranges, in order."""
    if parts < 1:
        raise DataFileError(f"cannot cut a file into {parts} byte ranges: give at least 1")
    cuts = [start + (size - start) * index // parts for index in range(parts + 1)]
    return list(itertools.pairwise(cuts))


def line_start(handle: io.BufferedIOBase, offset: int, path: str | Path, max_line: int) -> int:
    """The first line start at or after `offset` in the open plain file (its size when none);
    raises when no newline comes within `max_line` bytes (a file that is not text lines)."""
    if offset == 0:
        return 0
    handle.seek(offset - 1)  # a line starts at `offset` when the byte before it is a newline
    scanned = 0
    while True:
        piece = handle.read(ALIGN_BYTES)
        if not piece:
            return offset - 1 + scanned
        newline = piece.find(b"\n")
        if newline >= 0:
            return offset + scanned + newline
        scanned += len(piece)
        if scanned > max_line:
            raise DataFileError(
                f"{path}: no newline in the {max_line} bytes after byte {offset}: not a file "
                "of text lines (or a line far longer than the format allows)"
            )


def offset_after_lines(path: str | Path, lines: int) -> int:
    """The byte offset just after the file's first `lines` lines (its size if it has fewer)."""
    offset, seen = 0, 0
    with open(path, "rb") as handle:
        while seen < lines:
            piece = handle.read(SCAN_BYTES)
            if not piece:
                break
            count = piece.count(b"\n")
            if seen + count < lines:
                seen, offset = seen + count, offset + len(piece)
                continue
            at = -1
            for _ in range(lines - seen):
                at = piece.find(b"\n", at + 1)
            return offset + at + 1
    return offset


def lines_before(path: str | Path, offset: int) -> int:
    """How many lines end before byte `offset`: the line starting there is number this + 1.
    Reads the file's first `offset` bytes, so readers call it only to name a line in an error."""
    count, left = 0, offset
    with open(path, "rb") as handle:
        while left > 0:
            piece = handle.read(min(SCAN_BYTES, left))
            if not piece:
                break
            count += piece.count(b"\n")
            left -= len(piece)
    return count
