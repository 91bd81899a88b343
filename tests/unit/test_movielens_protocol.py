"""The MovieLens ratings reader (manualpar.data) and the example's split: every GroupLens layout
reads to the same ratings, and the split is RecBole's leave-one-out by time (ties in file order,
nothing filtered, histories of 50)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from example_modules import load_example

from manualpar import DataFileError
from manualpar.data import movielens as ratings

protocol = load_example(Path("movielens/protocol.py"), "ml_protocol")

# (user, item, rating, time) in file order; user 7's items 30 and 31 share a timestamp
ROWS = [
    ("7", "30", "4", 100),
    ("9", "11", "3", 50),
    ("7", "31", "5", 100),
    ("7", "12", "1", 90),
    ("9", "30", "2", 40),
    ("7", "11", "2", 120),
    ("9", "12", "5", 60),
]


def _write_every_layout(directory: Path) -> list[Path]:
    inter = directory / "ml.inter"
    inter.write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
        + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ROWS)
    )
    u_data = directory / "u.data"
    u_data.write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ROWS))
    dat = directory / "ratings.dat"
    dat.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in ROWS))
    csv = directory / "ratings.csv"
    csv.write_text(
        "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in ROWS)
    )
    return [inter, u_data, dat, csv]


def test_every_layout_reads_the_same_ratings_in_file_order(tmp_path: Path) -> None:
    for path in _write_every_layout(tmp_path):
        read = ratings.read_ratings(path)
        assert read.users == [u for u, _, _, _ in ROWS], path
        assert read.items == [i for _, i, _, _ in ROWS], path
        assert read.timestamps == [float(t) for _, _, _, t in ROWS], path


def test_a_bad_line_names_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "u.data"
    path.write_text("1\t2\t3\t4\n1\t2\n")
    with pytest.raises(DataFileError, match=r"u\.data, line 2: cannot read '1\\t2'"):
        ratings.read_ratings(path)


def test_sequences_sort_by_time_keeping_file_order_for_ties(tmp_path: Path) -> None:
    sequences = protocol.user_sequences(ratings.read_ratings(_write_every_layout(tmp_path)[1]))
    # item ids by first appearance: 30 -> 0, 11 -> 1, 31 -> 2, 12 -> 3
    assert sequences.item_tokens == ["30", "11", "31", "12"]
    # user 7: 12 (90), 30 (100), 31 (100, after 30 in the file), 11 (120); user 9: 30, 11, 12
    assert sequences.items == [[3, 0, 2, 1], [0, 1, 3]]


def test_times_tie_as_recbole_rounds_them() -> None:
    """RecBole sorts by the timestamp scaled to [0, 1] and stored as float32: over ml-100k's
    range (18,561,928 s) a float32 step near 1 is about 1.1 s, so some timestamps a second
    apart tie and keep file order."""
    read = ratings.Ratings(
        users=["1", "1", "1", "1"],
        items=["a", "b", "c", "d"],
        timestamps=[874_724_710.0, 893_000_005.0, 893_000_004.0, 893_286_638.0],
        source="memory",
    )
    assert protocol.user_sequences(read).items == [[0, 1, 2, 3]]  # b before c: a tie
    raw = sorted(range(4), key=lambda i: read.timestamps[i])
    assert raw == [0, 2, 1, 3]  # what a sort by the raw timestamps would give


def test_leave_one_out_targets_and_histories() -> None:
    long_user = list(range(60))
    split = protocol.leave_one_out(protocol.Sequences([[3, 0, 2, 1], long_user], ["a"] * 60))
    assert split.train == [[3, 0], long_user[:58]]
    assert split.valid.targets.tolist() == [2, 58]
    assert split.test.targets.tolist() == [1, 59]
    # the test history holds the validation item; at most the last 50 items, -1 after
    assert split.test.histories[0, :4].tolist() == [3, 0, 2, -1]
    assert split.test.lengths.tolist() == [3, 50]
    assert split.test.histories[1].tolist() == long_user[9:59]
    assert split.valid.histories[1].tolist() == long_user[8:58]


def test_training_windows_hold_every_training_target_once() -> None:
    train = [list(range(100, 103)), list(range(120))]
    windows = protocol.training_windows(train)
    targets: list[int] = []
    for window in windows:
        items = window[window >= 0]
        assert 2 <= len(items) <= protocol.MAX_HISTORY + 1
        targets += items[1:].tolist()
    expected = [t for items in train for t in items[1:]]
    assert sorted(targets) == sorted(expected)
    # the last window of a long history ends at its last item and sees 50 items before it
    assert torch.equal(windows[1], torch.arange(69, 120))


def test_prefix_samples_are_recboles_training_samples() -> None:
    """RecBole's recipe: one sample per training target after a user's first item (targets
    s[1..n-3] of a user with n items), the history the up to 50 items before it."""
    long_user = list(range(100, 160))  # 60 items: 57 training targets, histories cut at 50
    split = protocol.leave_one_out(
        protocol.Sequences([[3, 0, 2, 1], [5, 6, 7], long_user], ["a"] * 160)
    )
    samples = protocol.prefix_samples(split.train)
    width = protocol.MAX_HISTORY
    assert samples.shape == (1 + 0 + 57, width + 1)
    got = [(row[:width][row[:width] >= 0].tolist(), int(row[width])) for row in samples]
    assert got[0] == ([3], 0)  # the 4-item user: one sample; the 3-item user: none
    assert got[1:] == [(long_user[max(0, j - width) : j], long_user[j]) for j in range(1, 58)]
    assert got[50] == (long_user[0:50], long_user[50])
    assert got[57] == (long_user[7:57], long_user[57])  # the last: s[n-3], 50 items before
    assert all(
        row[len(history) : width].eq(-1).all()
        for row, (history, _) in zip(samples, got, strict=True)
    )


def test_prefix_batches_put_each_target_at_its_history_end_only() -> None:
    model = load_example(Path("movielens/model.py"), "ml_model", {"protocol": protocol})
    batches = load_example(
        Path("movielens/batches.py"), "ml_batches", {"protocol": protocol, "model": model}
    )
    samples = protocol.prefix_samples([[4, 8, 15, 16, 23, 42], [7, 9]])
    data = batches.prefix_batches(samples, global_batch=6, seed=0)
    batch = data(0, SimpleNamespace(rank=0, world_size=1))
    width = protocol.MAX_HISTORY
    pairs = []
    for items, targets in zip(batch.items, batch.targets, strict=True):
        length = int((items >= 0).sum())
        assert targets.ne(-1).nonzero().flatten().tolist() == [length - 1]
        pairs.append((items[:length].tolist(), int(targets[length - 1])))
    expected = [(row[:width][row[:width] >= 0].tolist(), int(row[width])) for row in samples]
    assert sorted(pairs) == sorted(expected)  # the epoch's shuffle, every sample once
