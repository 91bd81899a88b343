"""The Criteo reader (manualpar.data): exact values against a line-by-line Python parse, plain
and gzip alike; every line read by exactly one rank; malformed lines named by file and line, or
skipped and counted up to a share; blank lines tolerated; the step-addressed stream the Trainer
reads. Byte-range shares: test_data_byte_ranges.py."""

from __future__ import annotations

import gzip
import math
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from example_modules import load_example

from manualpar import DataFileError
from manualpar import data as criteo
from manualpar.data import Columns

example_data = load_example(Path("recsys/data.py"), "recsys_data")
write_criteo = load_example(
    Path("recsys/write_criteo.py"), "recsys_write_criteo", siblings={"data": example_data}
)
write_synthetic_criteo = write_criteo.write_synthetic_criteo


def reference(lines: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels, dense and ids parsed one field at a time with int(), as the format says."""
    labels, dense, ids = [], [], []
    for line in lines:
        fields = line.rstrip("\r\n").split("\t")
        labels.append(int(fields[0]))
        counts = [max(int(v), 0) if v else 0 for v in fields[1:14]]
        dense.append([math.log1p(c) for c in counts])
        ids.append([int(v, 16) if v else criteo.MISSING_ID for v in fields[14:]])
    return np.array(labels), np.array(dense, dtype=np.float32), np.array(ids, dtype=np.int64)


def line(label: str = "0", ints: list[str] | None = None, hexes: list[str] | None = None) -> str:
    ints = ints if ints is not None else [""] * 13
    hexes = hexes if hexes is not None else [""] * 26
    return "\t".join([label, *ints, *hexes]) + "\n"


def write(path: Path, lines: list[str]) -> Path:
    text = "".join(lines).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text))
    else:
        path.write_bytes(text)
    return path


def read_all(paths: list[Path], read_bytes: int = criteo.READ_BYTES) -> Columns:
    share = criteo.rank_share(paths, 0, 1)
    return Columns.concat(list(criteo.read_share(share, read_bytes=read_bytes)))


EDGE_LINES = [
    line("1", ["5", "", "-2", "0", "123456789012", "99999999", *map(str, range(7))],
         ["68fd1e64", "80E26C9B", "", "a", "FFFFFFFF", "00000000", *["0000000a"] * 20]),
    line("0"),  # every value missing
    line("1", ["7"] * 13, ["ffffffff"] * 26).replace("\n", "\r\n"),  # Windows line end
    line("0", ["-1234567890"] + ["1"] * 12, ["1"] * 26).rstrip("\n"),  # last line, no newline
]  # fmt: skip


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_values_are_exact_on_edge_lines(tmp_path: Path, suffix: str) -> None:
    columns = read_all([write(tmp_path / f"day{suffix}", EDGE_LINES)])
    labels, dense, ids = reference(EDGE_LINES)
    assert columns.labels.tolist() == labels.tolist()
    assert np.array_equal(columns.dense, dense) and columns.dense.dtype == np.float32
    assert np.array_equal(columns.ids, ids)
    assert columns.ids[1].tolist() == [criteo.MISSING_ID] * 26
    assert columns.ids[0, :4].tolist() == [0x68FD1E64, 0x80E26C9B, criteo.MISSING_ID, 10]
    batch = columns.batch()  # the example's Batch: ids feature-major, one per sample
    assert batch.sparse.values.view(26, 4).T.tolist() == ids.tolist()
    assert torch.equal(batch.labels, torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_plain_and_gzip_give_the_same_batches_and_exact_values(tmp_path: Path) -> None:
    plain = write_synthetic_criteo(tmp_path / "day", 3000, max_rows=500)
    packed = write_synthetic_criteo(tmp_path / "day.gz", 3000, max_rows=500)
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    lines = plain.read_text().splitlines(keepends=True)
    labels, dense, ids = reference(lines)
    assert any("\t\t" in text for text in lines) and any("\t-1\t" in text for text in lines)
    for path in (plain, packed):
        for read_bytes in (criteo.READ_BYTES, 1000):  # many blocks, lines cut across reads
            columns = read_all([path], read_bytes)
            assert np.array_equal(columns.labels, labels)
            assert np.array_equal(columns.dense, dense)
            assert np.array_equal(columns.ids, ids)
    share = criteo.rank_share([plain], 0, 1)
    for one, other in zip(
        criteo.share_batches(share, 256),
        criteo.share_batches(criteo.rank_share([packed], 0, 1), 256),
        strict=True,
    ):
        assert torch.equal(one.dense, other.dense) and torch.equal(one.labels, other.labels)
        assert torch.equal(one.sparse.values, other.sparse.values)
    assert (
        len(list(criteo.share_batches(share, 256))) == 3000 // 256
    )  # the partial batch is dropped
    assert len(list(criteo.share_batches(share, 256, drop_last=False))) == 3000 // 256 + 1


def numbered_files(tmp_path: Path, sizes: list[int]) -> tuple[list[Path], list[list[int]]]:
    """Files of `sizes` lines (odd ones gzip) whose C1 is the line's number across all files
    (C2: the file); and each file's numbers."""
    paths, numbers, start = [], [], 0
    for index, size in enumerate(sizes):
        lines = [line(hexes=[f"{start + i:x}", f"{index:x}", *[""] * 24]) for i in range(size)]
        paths.append(write(tmp_path / f"day_{index}{'.gz' if index % 2 else ''}", lines))
        numbers.append(list(range(start, start + size)))
        start += size
    return paths, numbers


def line_starts(path: Path) -> list[int]:
    """The byte offset of each line of a plain file."""
    text = path.read_bytes()
    return [0, *(i + 1 for i, byte in enumerate(text[:-1]) if byte == 10)]


def in_byte_range(path: Path, held: int, rank: int, world: int) -> list[int]:
    """Indices of the lines of plain `path` in byte range `rank` of `world` equal ranges cut
    from the bytes after its first `held` lines: those starting inside it."""
    starts = line_starts(path)
    size = path.stat().st_size
    origin = starts[held] if held < len(starts) else size
    begin, end = (origin + (size - origin) * k // world for k in (rank, rank + 1))
    return [i for i, start in enumerate(starts) if begin <= start < end and i >= held]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sizes", [[700, 50, 1201], [2000], [900, 1300]])
@pytest.mark.parametrize("skip", [0, 17])
def test_shares_cover_every_line_exactly_once(
    tmp_path: Path, world: int, sizes: list[int], skip: int
) -> None:
    paths, numbers = numbered_files(tmp_path, sizes)
    read = []
    for rank in range(world):
        share = criteo.rank_share(paths, rank, world, skip=skip)
        mine = Columns.concat(list(criteo.read_share(share, read_bytes=4096))).ids[:, 0]
        if len(paths) >= world:  # whole files: file j to rank j % world
            assert share.files == tuple(str(p) for p in paths[rank::world])
        else:  # plain files by byte ranges; gzip: line i (after the head) to rank i % world
            expected: list[int] = []
            for index, (path, file_numbers) in enumerate(zip(paths, numbers, strict=True)):
                held = skip if index == 0 else 0
                if path.suffix == ".gz":
                    expected += file_numbers[held:][rank::world]
                else:
                    expected += [file_numbers[i] for i in in_byte_range(path, held, rank, world)]
            assert mine.tolist() == expected
        read += mine.tolist()
    every = [n for file_numbers in numbers for n in file_numbers]
    assert sorted(read) == every[skip:]  # every line once; the head held out of training


BAD_LINES = {
    "wrong field count": (
        line().replace("\t", "", 1),
        "line {n}: expected 40 tab-separated fields (label, 13 integers, 26 hex strings), got 39",
    ),
    "non-integer": (
        line("1", ["3", "1.5", *[""] * 11]),
        "line {n}: field 3 (I2) is '1.5', not an integer (up to 18 digits, optional '-') or empty",
    ),
    "lone minus": (
        line("1", ["-", *[""] * 12]),
        "line {n}: field 2 (I1) is '-', not an integer",
    ),
    "bad hex": (
        line("0", hexes=["", "", "0x1f", *[""] * 23]),
        "line {n}: field 17 (C3) is '0x1f', not a hex string (1 to 8 digits) or empty",
    ),
    "hex too long": (
        line("0", hexes=[*[""] * 25, "123456789"]),
        "line {n}: field 40 (C26) is '123456789', not a hex string",
    ),
    "bad label": (line("2"), "line {n}: field 1 (label) is '2', not a label (0 or 1)"),
    "empty label": (line(""), "line {n}: field 1 (label) is '', not a label (0 or 1)"),
    "a lone space": (
        " \n",
        "line {n}: expected 40 tab-separated fields (label, 13 integers, 26 hex strings), got 1",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_malformed_lines_name_the_file_and_line(tmp_path: Path, kind: str, suffix: str) -> None:
    bad, message = BAD_LINES[kind]
    good = write_synthetic_criteo(tmp_path / "good", 40, max_rows=100)
    lines = good.read_text().splitlines(keepends=True)
    path = write(tmp_path / f"day{suffix}", [*lines[:33], bad, *lines[33:]])
    with pytest.raises(DataFileError, match=re.escape(f"{path}, {message}".format(n=34))):
        read_all([path], read_bytes=2000)  # the bad line lies in a later block
    # on 2 ranks (by lines of a gzip file, by byte ranges of a plain one), rank 1 holds line 34
    # (index 33) and names it by its number in the file; rank 0 reads its lines without error
    first_half = 21 if suffix else len(in_byte_range(path, 0, 0, 2))
    for rank in range(2):
        share = criteo.rank_share([path], rank, 2)
        if rank == 1:
            with pytest.raises(DataFileError, match=re.escape(f"{path}, line 34:")):
                list(criteo.read_share(share, read_bytes=2000))
        else:
            assert len(Columns.concat(list(criteo.read_share(share, read_bytes=2000)))) == (
                first_half
            )


def test_stream_resumes_stops_and_holds_out_validation(tmp_path: Path) -> None:
    paths = [write_synthetic_criteo(tmp_path / f"day_{i}", 1000, start=1000 * i) for i in (0, 1)]
    every = [
        criteo.CriteoStream(paths[:1], rank=r, world=2, batch_size=200, val_samples=300)
        for r in range(2)
    ]
    batches = [[s.train(step) for step in range(3)] for s in every]  # 700 lines / 2 ranks / 100
    mine = [in_byte_range(paths[0], 300, rank, 2) for rank in range(2)]  # about 350 lines each
    assert sorted(mine[0] + mine[1]) == list(range(300, 1000)) and min(map(len, mine)) < 400
    for rank, stream in enumerate(every):
        with pytest.raises(StopIteration):
            stream.train(3)
        resumed = criteo.CriteoStream(
            paths[:1], rank=rank, world=2, batch_size=200, val_samples=300
        )
        assert torch.equal(resumed.train(2).sparse.values, batches[rank][2].sparse.values)
        held_out = stream.validation(0)  # lines 0, 2, ... (rank 0) of the first 300
        assert len(held_out) == 150
    lines = paths[0].read_text().splitlines(keepends=True)
    _, _, ids = reference(lines)
    for rank in range(2):  # each rank's first lines after the held-out head, in file order
        first = mine[rank][0]
        values = batches[rank][0].sparse.values.view(26, 100).T
        assert values.tolist() == ids[first : first + 100].tolist()
    assert every[1].validation(0).sparse.values.view(26, 150).T.tolist() == ids[1:300:2].tolist()
    separate = criteo.CriteoStream(
        paths[:1], rank=0, world=1, batch_size=100, val_samples=1500, val_files=paths
    )
    assert len(separate.validation(0)) == 1500  # across both files; training keeps every line
    assert separate.train(0).sparse.values.view(26, 100).T.tolist() == ids[:100].tolist()
    with pytest.raises(DataFileError, match=r"hold 2000 lines, fewer than the 2001 asked for"):
        criteo.read_head(paths, 2001, 0, 1)


def test_truncated_gzip_and_text_without_newlines_are_named(tmp_path: Path) -> None:
    good = write_synthetic_criteo(tmp_path / "day.gz", 2000, max_rows=100)
    cut = tmp_path / "cut.gz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataFileError, match=rf"{re.escape(str(cut))}, after line \d+: "
                       "cannot decompress: Compressed file ended"):  # fmt: skip
        read_all([cut], read_bytes=4096)
    blob = tmp_path / "blob"
    blob.write_bytes(b"x" * (criteo.MAX_LINE_BYTES + 2))
    with pytest.raises(DataFileError, match=re.escape(f"{blob}, line 1: longer than")):
        read_all([blob])


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_blank_lines_anywhere_are_not_samples(tmp_path: Path, suffix: str) -> None:
    good = write_synthetic_criteo(tmp_path / "good", 60, max_rows=100)
    lines = good.read_text().splitlines(keepends=True)
    with_blanks = ["\n", *lines[:20], "\n", "\r\n", *lines[20:], "\n", "\n"]  # end too
    path = write(tmp_path / f"day{suffix}", with_blanks)
    labels, dense, ids = reference(lines)
    for read_bytes in (criteo.READ_BYTES, 1000):
        columns = read_all([path], read_bytes)
        assert np.array_equal(columns.labels, labels) and np.array_equal(columns.ids, ids)
        assert np.array_equal(columns.dense, dense)
    shares = [criteo.rank_share([path], rank, 2) for rank in range(2)]
    read = [Columns.concat(list(criteo.read_share(s, read_bytes=1000))).ids for s in shares]
    assert sorted(map(tuple, np.concatenate(read).tolist())) == sorted(map(tuple, ids.tolist()))


def _with_bad_lines(tmp_path: Path, suffix: str) -> tuple[Path, list[str]]:
    """1000 good lines with 3 bad ones inserted: lines 5, 400 and 1003 of the file."""
    good = write_synthetic_criteo(tmp_path / "good", 1000, max_rows=100)
    lines = good.read_text().splitlines(keepends=True)
    text = [*lines[:4], BAD_LINES["bad hex"][0], *lines[4:398], BAD_LINES["bad label"][0]]
    text += [*lines[398:], BAD_LINES["wrong field count"][0]]
    return write(tmp_path / f"day{suffix}", text), lines


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_bad_lines_are_skipped_and_counted_up_to_a_share(tmp_path: Path, suffix: str) -> None:
    path, lines = _with_bad_lines(tmp_path, suffix)
    with pytest.raises(DataFileError, match=re.escape(f"{path}, line 5: field 17")):
        read_all([path], read_bytes=3000)  # the default policy raises
    policy = criteo.BadLines("skip", max_share=0.01)
    share = criteo.rank_share([path], 0, 1)
    columns = Columns.concat(list(criteo.read_share(share, read_bytes=3000, bad_lines=policy)))
    labels, dense, ids = reference(lines)
    assert np.array_equal(columns.labels, labels) and np.array_equal(columns.ids, ids)
    assert np.array_equal(columns.dense, dense)
    assert (policy.skipped, policy.lines) == (3, 1003)
    assert policy.summary() == "skipped 3 malformed lines of 1003 read (0.299%)"
    assert policy.first == (
        f"{path}, line 5: field 17 (C3) is '0x1f', not a hex string (1 to 8 digits) or empty"
    )
    strict = criteo.BadLines("skip", max_share=0.002)  # 3 of 1003 is more than 0.2%
    with pytest.raises(DataFileError) as refused:
        list(criteo.read_share(share, read_bytes=3000, bad_lines=strict))
    assert str(refused.value) == (
        f"{path}: 3 of the 1003 lines read so far were malformed and skipped (0.30%), more "
        f"than the allowed 0.20%; the first: {path}, line 5: field 17 (C3) is '0x1f', not a "
        "hex string (1 to 8 digits) or empty. Fix or filter the files, or allow a larger "
        "share of bad lines"
    )
    early = criteo.BadLines("skip", max_share=0.002, min_lines=100)  # checked per block:
    with pytest.raises(DataFileError, match=r": 1 of the 1\d\d lines read so far"):
        list(criteo.read_share(share, read_bytes=3000, bad_lines=early))  # before line 400
    with pytest.raises(DataFileError, match=r"bad-lines policy must be one of \('raise', 'skip'\)"):
        criteo.BadLines("drop")


def test_a_truncated_gzip_names_its_last_complete_line(tmp_path: Path) -> None:
    good = write_synthetic_criteo(tmp_path / "day.gz", 2000, max_rows=100)
    cut = tmp_path / "cut.gz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    complete = zlib.decompressobj(31).decompress(cut.read_bytes()).count(b"\n")
    assert 0 < complete < 2000
    for read_bytes in (criteo.READ_BYTES, 4096):  # inside the first block, and a later one
        with pytest.raises(DataFileError) as error:
            read_all([cut], read_bytes=read_bytes)
        assert str(error.value) == (
            f"{cut}, after line {complete}: cannot decompress: Compressed file ended before the "
            f"end-of-stream marker was reached. The file is truncated or corrupted after line "
            f"{complete} (its last complete line); download or compress it again"
        )


def test_a_huge_field_is_cut_in_the_message(tmp_path: Path) -> None:
    huge = "g" * 500 * 1024
    path = write(tmp_path / "day", [line(), line("1", hexes=["", huge, *[""] * 24])])
    with pytest.raises(DataFileError) as error:
        read_all([path])
    assert str(error.value) == (
        f"{path}, line 2: field 16 (C2) is '{'g' * 80}... (512000 chars)', not a hex string "
        "(1 to 8 digits) or empty"
    )
