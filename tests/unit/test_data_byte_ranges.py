"""Plain files shared by byte ranges (manualpar.data): the ranks' ranges hold every line exactly
once wherever the cuts fall, each rank reads about 1/world of the bytes, a range with no line
start is empty, and errors are manualpar's, naming the file and the line's number in the file."""

from __future__ import annotations

import gzip
import io
import itertools
import re
from collections import Counter
from pathlib import Path

import pytest

import manualpar as mp
from manualpar.data import Columns, CriteoStream, byte_ranges, rank_share, read_share
from manualpar.data import lines as lines_module
from manualpar.data.lines import line_blocks

TEXT = [b"a\n", b"\n", b"bb\n", b"a long line in the middle\n", b"c\n", b"\r\n", b"dd\n", b"e"]


def read_range(path: Path, begin: int, end: int) -> bytes:
    return b"".join(bytes(block) for block, _ in line_blocks(path, 4, begin=begin, end=end))


def cut_points(size: int, world: int) -> list[list[int]]:
    """Every way to cut bytes [0, size) into `world` ranges (empty ones included)."""
    return [[0, *inner, size] for inner in _inner_cuts(size, world - 1, 0)]


def _inner_cuts(size: int, count: int, low: int) -> list[list[int]]:
    """Every non-decreasing list of `count` offsets in [low, size]."""
    if count == 0:
        return [[]]
    return [[c, *rest] for c in range(low, size + 1) for rest in _inner_cuts(size, count - 1, c)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_byte_ranges_hold_every_line_once_wherever_the_cuts_fall(
    tmp_path: Path, world: int
) -> None:
    """Every placement of the cuts (on a line start, mid-line, on a newline, two cuts in one
    line, which leaves a range empty): the ranges' lines in order are the file's lines."""
    path = tmp_path / "text"
    path.write_bytes(b"".join(TEXT))
    size = path.stat().st_size
    whole = b"".join(TEXT) + b"\n"  # the last line gets its newline
    assert b"".join(read_range(path, b, e) for b, e in byte_ranges(size, world)) == whole
    for cuts in cut_points(size, world):
        ranges = [read_range(path, b, e) for b, e in itertools.pairwise(cuts)]
        assert b"".join(ranges) == whole, cuts
        assert all(r == b"" or r.endswith(b"\n") for r in ranges)


def test_a_range_without_a_line_start_is_empty(tmp_path: Path) -> None:
    """3 ranks on a 2-line file: one rank's range lies inside a line, so it has no batch."""
    path = tmp_path / "day"
    line = "\t".join(["1", *[""] * 13, *["a"] * 26]) + "\n"
    path.write_text(line * 2)
    shares = [rank_share([path], rank, 3) for rank in range(3)]
    counts = [len(Columns.concat(list(read_share(s, read_bytes=64)))) for s in shares]
    assert sorted(counts) == [0, 1, 1]
    empty = counts.index(0)
    stream = CriteoStream([path], rank=empty, world=3, batch_size=3, val_samples=0)
    with pytest.raises(StopIteration):
        stream.train(0)


def test_fewer_files_than_ranks_each_rank_reads_its_part_of_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One plain file, 3 ranks: each reads about a third of its bytes (it read all of them when
    ranks kept every third line); a gzip file is still read whole by every rank."""
    fields = [*map(str, range(13)), *(f"{i:08x}" for i in range(26))]
    rows = [f"{i % 2}\t" + "\t".join(fields) + "\n" for i in range(3000)]
    plain, packed = tmp_path / "day", tmp_path / "day.gz"
    plain.write_text("".join(rows))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    read: Counter[str] = Counter()

    class Counted(io.FileIO):
        def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
            got = super().readinto(buffer) or 0
            read[str(self.name)] += got
            return got

    def open_counted(path: str | Path) -> io.BufferedIOBase:
        raw = io.BufferedReader(Counted(str(path)))
        return gzip.GzipFile(fileobj=raw) if lines_module.is_gzip(path) else raw

    monkeypatch.setattr(lines_module, "open_log", open_counted)
    size, lines = plain.stat().st_size, []
    for rank in range(3):
        read.clear()
        share = rank_share([plain], rank, 3)
        lines.append(len(Columns.concat(list(read_share(share, read_bytes=16_384)))))
        assert size / 3 - 300 < read[str(plain)] < size / 3 + 2 * 16_384, (rank, read, size)
        read.clear()
        list(read_share(rank_share([packed], rank, 3), read_bytes=16_384))
        assert read[str(packed)] == packed.stat().st_size  # gzip: decompressed whole
    assert sum(lines) == 3000 and max(lines) - min(lines) <= 1


def test_errors_are_manualpars_and_name_the_file_and_line(tmp_path: Path) -> None:
    """A bad line in the last rank's range is named by its number in the file (counted only
    for the message); a truncated gzip, too few validation lines and a bad ratings line too."""
    good = "\t".join(["0", *["1"] * 13, *["ab"] * 26]) + "\n"
    bad = good.replace("\tab\n", "\txyz\n")
    path = tmp_path / "day"
    path.write_text(good * 2000 + bad + good * 99)
    last = rank_share([path], 2, 3)
    assert last.parts[0].begin > 0
    with pytest.raises(mp.DataFileError, match=re.escape(f"{path}, line 2001: field 40 (C26)")):
        list(read_share(last, read_bytes=4096))
    assert issubclass(mp.DataFileError, mp.ManualParError) and issubclass(
        mp.DataFileError, ValueError
    )
    cut = tmp_path / "cut.gz"
    packed = gzip.compress((good * 2000).encode())
    cut.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(mp.DataFileError, match=rf"{re.escape(str(cut))}, after line \d+: "):
        list(read_share(rank_share([cut], 0, 1)))
    with pytest.raises(mp.DataFileError, match="global batch 10 is not a multiple of 3 ranks"):
        CriteoStream([path], rank=0, world=3, batch_size=10, val_samples=0)
    ratings = tmp_path / "u.data"
    ratings.write_text("1\t2\t4\t100\n1\t3\t5\tnoon\n")
    with pytest.raises(mp.DataFileError, match=re.escape(f"{ratings}, line 2: cannot read")):
        mp.data.read_ratings(ratings)
    with pytest.raises(mp.DataFileError, match=re.escape(f"{tmp_path / 'none'}: no such")):
        mp.data.read_ratings(tmp_path / "none")
