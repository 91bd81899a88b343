"""Bytes of Criteo-format logs: reading whole lines a block at a time (plain or gzip), decoding
numeric fields in bulk, and what to do with lines that are not in the format.

`line_blocks` reads `READ_BYTES` at a time in pieces, so a truncated gzip names the last complete
line it decompressed. Blank lines are not samples and are dropped (`drop_blank_lines`). A
malformed line raises by default; `BadLines(policy="skip")` counts and skips them, but refuses
once more than `max_share` of the lines read were bad: a file that is mostly bad is not Criteo's
format, and skipping it silently would train on almost nothing. Field texts in messages are
cut (`excerpt`), so a huge field never floods a log.
"""

from __future__ import annotations

import gzip
import io
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "BAD_LINE_POLICIES",
    "BadLines",
    "CriteoFormatError",
    "decode_numbers",
    "drop_blank_lines",
    "excerpt",
    "line_blocks",
    "select_lines",
]

MAX_HEX_DIGITS = 8
MAX_INT_DIGITS = 18  # any 18-digit integer fits in int64
READ_BYTES = 1 << 22  # bytes read (after decompression) per block: about 17k Kaggle lines
MAX_LINE_BYTES = 1 << 20  # Criteo lines are a few hundred bytes: longer is not this format
EXCERPT_CHARS = 80  # of a field's text in an error message

TAB, NEWLINE, CR, MINUS, ZERO = 9, 10, 13, ord("-"), ord("0")
_DIGIT = np.full(256, -1, dtype=np.int64)
_DIGIT[ZERO : ZERO + 10] = np.arange(10)
BAD_LINE_POLICIES = ("raise", "skip")
log = logging.getLogger("manualpar.examples.criteo")


class CriteoFormatError(ValueError):
    """A line that is not in Criteo's format; the message names the file, the 1-based line
    number and what is wrong."""


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text`, or its first `limit` characters and its length when longer (for messages)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


@dataclass
class BadLines:
    """What a reader does with a malformed line, and its count so far.

    policy "raise" (the default): raise CriteoFormatError naming it. "skip": leave it out, count
    it, and raise once more than `max_share` of the lines read so far were bad; the share is
    checked after every block from `min_lines` lines on, and at the end of every file.
    """

    policy: str = "raise"
    max_share: float = 0.001
    min_lines: int = 10_000
    lines: int = 0  # lines read (blank ones not counted)
    skipped: int = 0
    first: str | None = None  # the first skipped line's error

    def __post_init__(self) -> None:
        if self.policy not in BAD_LINE_POLICIES:
            raise ValueError(
                f"bad-lines policy must be one of {BAD_LINE_POLICIES}, got {self.policy!r}"
            )
        if not 0 <= self.max_share < 1:
            raise ValueError(f"bad-lines max_share must be in [0, 1), got {self.max_share}")

    def bad(self, count: int, message: str) -> None:
        """`count` malformed lines in a block, the first of which `message` describes."""
        if self.policy == "raise":
            raise CriteoFormatError(message)
        if self.first is None:
            self.first = message
            log.warning(
                "%s; skipping malformed lines (bad-lines policy 'skip', at most %.3g%% of them)",
                message,
                100 * self.max_share,
            )
        self.skipped += count

    def check(self, path: str | Path, *, end_of_file: bool = False) -> None:
        """Raise if more than `max_share` of the lines read so far were skipped."""
        if self.skipped == 0 or not (end_of_file or self.lines >= self.min_lines):
            return
        if self.skipped > self.max_share * self.lines:
            raise CriteoFormatError(
                f"{path}: {self.skipped} of the {self.lines} lines read so far were malformed "
                f"and skipped ({self.skipped / self.lines:.2%}), more than the allowed "
                f"{self.max_share:.2%}; the first: {self.first}. Fix or filter the files, or "
                "allow a larger share of bad lines"
            )

    def summary(self) -> str:
        share = self.skipped / self.lines if self.lines else 0.0
        return f"skipped {self.skipped} malformed lines of {self.lines} read ({share:.3%})"


# ---- whole lines, a block at a time -------------------------------------------------------
def open_log(path: str | Path) -> io.BufferedIOBase:
    """A binary stream of the file's lines, gunzipped when it starts with gzip's magic bytes."""
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(path, "rb")
    return open(path, "rb")


def line_blocks(path: str | Path, read_bytes: int = READ_BYTES) -> Iterator[tuple[np.ndarray, int]]:
    """(bytes of whole lines as uint8, each ending in a newline; 0-based number of the block's
    first line in the file), in file order, `read_bytes` at a time: constant memory."""
    first, tail = 0, b""
    with open_log(path) as handle:
        while True:
            chunk = _read(handle, read_bytes, path, first + tail.count(b"\n"))
            if not chunk:
                break
            end = chunk.rfind(b"\n")
            if end < 0:
                tail += chunk
                if len(tail) > MAX_LINE_BYTES:
                    raise CriteoFormatError(
                        f"{path}, line {first + 1}: longer than {MAX_LINE_BYTES} bytes without a "
                        "newline: not a Criteo-format text file"
                    )
                continue
            block = np.frombuffer(tail + chunk[: end + 1], dtype=np.uint8)
            tail = chunk[end + 1 :]
            yield block, first
            first += int(np.count_nonzero(block == NEWLINE))
    if tail:  # a last line without its newline
        yield np.frombuffer(tail + b"\n", dtype=np.uint8), first


def _read(handle: io.BufferedIOBase, size: int, path: str | Path, complete: int) -> bytes:
    """Up to `size` bytes, in the pieces the stream gives (`read1`), so that when a gzip stream
    breaks off, the lines decompressed before it are counted: the error names the last
    complete line (`complete` lines came before this read)."""
    pieces: list[bytes] = []
    got = 0
    while got < size:
        try:
            piece = handle.read1(size - got)
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            last = complete + sum(p.count(b"\n") for p in pieces)
            raise CriteoFormatError(
                f"{path}, after line {last}: cannot decompress: {error}. The file is truncated "
                f"or corrupted after line {last} (its last complete line); download or "
                "compress it again"
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


# ---- numbers, all fields of a block at once -------------------------------------------------
def decode_numbers(
    padded: np.ndarray, ends: np.ndarray, lengths: np.ndarray, *, hexadecimal: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(values, bad): the unsigned decimal or hex numbers of `lengths` digits ending at `ends`
    (empty ones are 0). Up to 8 digits, a field's 8 bytes are loaded as one uint64 and decoded
    with bit arithmetic on all fields at once (SWAR); longer fields (decimal only) go digit by
    digit. Gathering each digit position instead (one array pass per position) read a plain
    file at 0.3M lines/s per process; this reads it at 0.7M (the whole reader, this machine)."""
    words = _last_eight_bytes(padded, ends)
    short = np.minimum(lengths, 8)
    fill = _PREFIX_MASK[short]  # the bytes before the field become '0'
    words = (words & ~fill) | (_ZEROS & fill)
    values, bad = (_swar_hex if hexadecimal else _swar_decimal)(words)
    long = lengths > 8
    if long.any():
        if hexadecimal:
            bad |= long
        else:
            block = padded[8:]
            values[long], bad[long] = _long_decimals(block, ends[long], lengths[long])
    return values, bad


def _last_eight_bytes(padded: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """uint64 words of block[end - 8 : end] (little-endian), from the block after 8 '0's."""
    words = np.ndarray((len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))
    return words[ends]


_BYTES = 0x0101010101010101
_HIGH = np.uint64(0x80 * _BYTES)
_ZEROS = np.uint64(ZERO * _BYTES)
# _PREFIX_MASK[k]: the low 8 - k bytes of a word (before a k-digit field ending at byte 8)
_PREFIX_MASK = np.array([(1 << (8 * (8 - k))) - 1 for k in range(9)], dtype=np.uint64)


def _u64(value: int) -> np.uint64:
    """A mask as uint64; a value under 0x100 repeated in every byte."""
    return np.uint64(value * _BYTES if value < 0x100 else value)


def _swar_decimal(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eight ASCII digits per word (first digit in the low byte) -> (int64 values, bad)."""
    ascii_ = (words & _HIGH) == 0
    at_least_0 = (words + _u64(0x80 - ZERO)) & _HIGH == _HIGH
    at_most_9 = (words + _u64(0x80 - ZERO - 10)) & _HIGH == 0
    bad = ~(ascii_ & at_least_0 & at_most_9)
    v = words - _ZEROS
    v = (v & _u64(0x00FF00FF00FF00FF)) * np.uint64(10) + (
        (v >> np.uint64(8)) & _u64(0x00FF00FF00FF00FF)
    )
    v = (v & _u64(0x0000FFFF0000FFFF)) * np.uint64(100) + (
        (v >> np.uint64(16)) & _u64(0x0000FFFF0000FFFF)
    )
    v = (v & _u64(0xFFFFFFFF)) * np.uint64(10000) + (v >> np.uint64(32))
    return v.astype(np.int64), bad


def _swar_hex(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eight ASCII hex digits per word (first digit in the low byte; either case) -> (int64
    values, bad)."""
    ascii_ = (words & _HIGH) == 0
    digit = (words + _u64(0x80 - ZERO)) & ~(words + _u64(0x80 - ZERO - 10)) & _HIGH
    lower = words | _u64(0x20)
    letter = (lower + _u64(0x80 - ord("a"))) & ~(lower + _u64(0x80 - ord("g"))) & _HIGH
    bad = ~(ascii_ & ((digit | letter) == _HIGH))
    v = (words & _u64(0x0F)) + np.uint64(9) * ((words >> np.uint64(6)) & _u64(0x01))
    v = ((v & _u64(0x00FF00FF00FF00FF)) << np.uint64(4)) | (
        (v >> np.uint64(8)) & _u64(0x00FF00FF00FF00FF)
    )
    v = ((v & _u64(0x0000FFFF0000FFFF)) << np.uint64(8)) | (
        (v >> np.uint64(16)) & _u64(0x0000FFFF0000FFFF)
    )
    v = ((v & _u64(0xFFFFFFFF)) << np.uint64(16)) | (v >> np.uint64(32))
    return v.astype(np.int64), bad


def _long_decimals(
    block: np.ndarray, ends: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(values, bad) of the few decimal fields longer than 8 digits, one digit position at a
    time (up to MAX_INT_DIGITS; longer ones are bad)."""
    values = np.zeros(len(ends), dtype=np.int64)
    bad = lengths > MAX_INT_DIGITS
    for place in range(min(int(lengths.max()), MAX_INT_DIGITS)):
        active = lengths > place
        digit = _DIGIT[block[np.where(active, ends - lengths + place, 0)]]
        bad |= active & (digit < 0)
        values = np.where(active, values * 10 + digit, values)
    return values, bad
