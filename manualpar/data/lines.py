"""Whole lines of a text file a block at a time, plain or gzip, the whole file or the lines of
one byte range (byte_ranges.py), in constant memory.

`line_blocks` reads `READ_BYTES` at a time in pieces, so a truncated gzip names the last complete
line it decompressed. Line numbers in messages are the file's: a reader of a byte range knows
only its lines' positions within the range, so `LinePlace` counts the lines before the range
the first time a message needs one (an error costs that scan; reading never does).
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from manualpar.data.byte_ranges import line_start, lines_before
from manualpar.errors import DataFileError

__all__ = [
    "MAX_LINE_BYTES",
    "NEWLINE",
    "READ_BYTES",
    "LinePlace",
    "drop_blank_lines",
    "is_gzip",
    "line_blocks",
    "open_log",
    "select_lines",
]

READ_BYTES = 1 << 22  # bytes read (after decompression) per block: about 17k Kaggle lines
MAX_LINE_BYTES = 1 << 20  # Criteo lines are a few hundred bytes: longer is not this format
FINISH_BYTES = 1 << 16  # read at a time past a range's end, to finish its last line
NEWLINE, CR = 10, 13
GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class LinePlace:
    """Names a line of `path` for messages. `start` is the byte where reading began and
    `before` the number of lines before it, counted on first use when not given."""

    path: str
    start: int = 0
    before: int | None = None

    def line(self, number: int) -> str:
        """'path, line N' for the `number`-th line read (1-based), N counted in the file."""
        return f"{self.path}, line {self.lines_before() + number}"

    def lines_before(self) -> int:
        if self.before is None:
            self.before = lines_before(self.path, self.start) if self.start else 0
        return self.before


def is_gzip(path: str | Path) -> bool:
    """Whether the file starts with gzip's magic bytes (its name does not matter)."""
    with open(path, "rb") as probe:
        return probe.read(2) == GZIP_MAGIC


def open_log(path: str | Path) -> io.BufferedIOBase:
    """A binary stream of the file's lines, gunzipped when it starts with gzip's magic bytes."""
    if is_gzip(path):
        return gzip.GzipFile(path, "rb")
    return open(path, "rb")


def line_blocks(
    path: str | Path,
    read_bytes: int = READ_BYTES,
    *,
    begin: int = 0,
    end: int | None = None,
    place: LinePlace | None = None,
) -> Iterator[tuple[np.ndarray, int]]:
    """(bytes of whole lines as uint8, each ending in a newline; 0-based number of the block's
    first line among those read), in file order, `read_bytes` at a time: constant memory.

    With `begin` or `end`, only the lines starting in bytes [begin, end) of a plain file (see
    byte_ranges.py); `place` then learns where reading began, for its messages."""
    place = place if place is not None else LinePlace(str(path))
    limit = end if end is not None else -1
    first, tail = 0, b""
    with open_log(path) as handle:
        position = 0  # the file offset of the next byte read
        if begin or end is not None:
            if isinstance(handle, gzip.GzipFile):
                raise DataFileError(
                    f"{path}: a gzip file cannot be read from a byte offset; decompress it to "
                    "share it by byte ranges"
                )
            position = line_start(handle, begin, path, MAX_LINE_BYTES)
            place.start, place.before = position, place.before if position == begin else None
            if position >= limit >= 0:
                return  # no line starts in the range
            handle.seek(position)
        while True:
            size = read_bytes
            if limit >= 0:  # to the range's end, then a little at a time to finish its last line
                size = min(read_bytes, limit - position if position < limit else FINISH_BYTES)
            chunk = _read(handle, size, place, first + tail.count(b"\n"))
            if not chunk:
                break
            position += len(chunk)
            if 0 <= limit <= position:  # the line spanning the range's end is the last one
                data = tail + chunk
                stop = data.find(b"\n", max(limit - 1 - (position - len(data)), 0))
                if stop >= 0:
                    yield np.frombuffer(data[: stop + 1], dtype=np.uint8), first
                    return
            newline = chunk.rfind(b"\n")
            if newline < 0:
                tail += chunk
                _check_length(tail, place, first)
                continue
            block = np.frombuffer(tail + chunk[: newline + 1], dtype=np.uint8)
            tail = chunk[newline + 1 :]
            yield block, first
            first += int(np.count_nonzero(block == NEWLINE))
    if tail:  # a last line without its newline
        yield np.frombuffer(tail + b"\n", dtype=np.uint8), first


def _check_length(tail: bytes, place: LinePlace, first: int) -> None:
    """Refuse a line growing past MAX_LINE_BYTES: the file is not text lines of the format."""
    if len(tail) > MAX_LINE_BYTES:
        raise DataFileError(
            f"{place.line(first + 1)}: longer than {MAX_LINE_BYTES} bytes without a newline: "
            "not a Criteo-format text file"
        )


def _read(handle: io.BufferedIOBase, size: int, place: LinePlace, complete: int) -> bytes:
    """Up to `size` bytes, in the pieces the stream gives (`read1`), so that when a gzip stream
    breaks off, the lines decompressed before it are counted: the error names the last
    complete line (`complete` lines came before this read)."""
    pieces: list[bytes] = []
    got = 0
    while got < size:
        try:
            piece = handle.read1(size - got)
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            last = place.lines_before() + complete + sum(p.count(b"\n") for p in pieces)
            raise DataFileError(
                f"{place.path}, after line {last}: cannot decompress: {error}. The file is "
                f"truncated or corrupted after line {last} (its last complete line); download "
                "or compress it again"
            ) from None
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)


def select_lines(block: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The block's lines where `keep` (one bool per line) is true, their bytes concatenated."""
    ends = np.flatnonzero(block == NEWLINE) + 1
    lengths = np.diff(ends, prepend=0)
    return block[np.repeat(keep, lengths)]


def drop_blank_lines(block: np.ndarray, numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The block without its empty lines ("\\n" or "\\r\\n"), and the remaining lines'
    numbers: a blank line (often the last of a file) is no sample, not a malformed one."""
    ends = np.flatnonzero(block == NEWLINE)
    lengths = np.diff(ends, prepend=-1) - 1
    blank = (lengths == 0) | ((lengths == 1) & (block[np.maximum(ends - 1, 0)] == CR))
    if not blank.any():
        return block, numbers
    return select_lines(block, ~blank), numbers[~blank]
