"""RecBole's sequential benchmark protocol, so that the numbers compare with RecBole's.

- Users and items become ids in order of first appearance in the file (item ids 0..N-1; no
  padding row: histories are jagged, and nothing else is scored).
- Each user's ratings are sorted by time, equal times kept in file order (a stable sort). The
  time is RecBole's: the timestamp scaled to [0, 1] over the whole file (in float64) and stored
  as float32, so timestamps a second or two apart tie too; on ml-100k this orders 83 users
  differently from the raw timestamps (examples/movielens/RECBOLE_PROTOCOL.md, (a)).
- Leave one out: the last item is the test target (its history holds the validation item),
  the second to last the validation target, the earlier ones training targets. Nothing is
  filtered: no rating threshold, no k-core, no de-duplication.
- Histories hold at most the last 50 items.

Training is ours to choose: one sequence window per user (or a few for long histories) with a
loss at every position (`training_windows`), or RecBole's own samples, one per prefix with a
loss at its last position only (`prefix_samples`), so the two frameworks run the same recipe;
the windows cost about 25x less per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from manualpar.data import Ratings

MAX_HISTORY = 50


@dataclass(frozen=True)
class Sequences:
    """Every user's items in time order (ids), and the item tokens by id."""

    items: list[list[int]]
    item_tokens: list[str]

    @property
    def num_items(self) -> int:
        return len(self.item_tokens)

    @property
    def num_users(self) -> int:
        return len(self.items)


def sort_keys(timestamps: list[float]) -> list[float]:
    """RecBole's sort key: (t - min) / (max - min) in float64, then rounded to float32."""
    times = np.asarray(timestamps, dtype=np.float64)
    low, high = times.min(), times.max()
    scaled = (times - low) / (high - low) if high > low else np.zeros_like(times)
    return scaled.astype(np.float32).tolist()


def user_sequences(ratings: Ratings) -> Sequences:
    """Group by user (in order of first appearance), each sorted by time, ties in file order."""
    item_ids: dict[str, int] = {}
    by_user: dict[str, list[tuple[float, int, int]]] = {}
    keys = sort_keys(ratings.timestamps)
    for position, (user, item, time) in enumerate(
        zip(ratings.users, ratings.items, keys, strict=True)
    ):
        item_id = item_ids.setdefault(item, len(item_ids))
        by_user.setdefault(user, []).append((time, position, item_id))
    return Sequences(
        [[item for _, _, item in sorted(entries)] for entries in by_user.values()],
        list(item_ids),
    )


@dataclass(frozen=True)
class Targets:
    """One evaluation target per user: `histories` (users, MAX_HISTORY) item ids, left-aligned,
    -1 after each history's `lengths`, and `targets`."""

    histories: torch.Tensor
    lengths: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.targets)


@dataclass(frozen=True)
class LeaveOneOut:
    train: list[list[int]]  # per user: the items up to the last training target
    valid: Targets
    test: Targets
    num_items: int


def leave_one_out(sequences: Sequences) -> LeaveOneOut:
    """The split above. A user with fewer than 3 items has no validation (and, with 1, no test)
    target; MovieLens users all have at least 20."""
    train, valid, test = [], [], []
    for items in sequences.items:
        n = len(items)
        train.append(items[: max(n - 2, 0)])
        if n >= 3:
            valid.append((items[: n - 2], items[n - 2]))
        if n >= 2:
            test.append((items[: n - 1], items[n - 1]))
    return LeaveOneOut(train, _targets(valid), _targets(test), sequences.num_items)


def _targets(pairs: list[tuple[list[int], int]]) -> Targets:
    histories = torch.full((len(pairs), MAX_HISTORY), -1, dtype=torch.int64)
    lengths = torch.zeros(len(pairs), dtype=torch.int64)
    for user, (history, _) in enumerate(pairs):
        kept = history[-MAX_HISTORY:]
        histories[user, : len(kept)] = torch.tensor(kept)
        lengths[user] = len(kept)
    return Targets(histories, lengths, torch.tensor([target for _, target in pairs]))


def training_windows(train: list[list[int]]) -> torch.Tensor:
    """(windows, MAX_HISTORY + 1) item ids, -1 after each window's end: each window's items
    1.. are targets of the items before them, and every training target is in exactly one
    window. A user's items are cut from the end into windows of MAX_HISTORY + 1 items that
    overlap by one (so the first targets of a user see their whole history, and a target
    early in a long history sees only its own window's items)."""
    width = MAX_HISTORY + 1
    windows = []
    for items in train:
        end = len(items)
        while end >= 2:
            start = max(end - width, 0)
            windows.append(items[start:end])
            end = start + 1
    out = torch.full((len(windows), width), -1, dtype=torch.int64)
    for row, window in enumerate(windows):
        out[row, : len(window)] = torch.tensor(window)
    return out


def prefix_samples(train: list[list[int]]) -> torch.Tensor:
    """(samples, MAX_HISTORY + 1) item ids: RecBole's training samples, one per training target
    after a user's first item. Row = the target's history (at most the last MAX_HISTORY items,
    left-aligned, -1 after it) then the target in the last column; users in order, each user's
    targets in time order (RecBole's `SequentialDataset.data_augmentation`)."""
    rows = [
        (items[max(0, j - MAX_HISTORY) : j], items[j])
        for items in train
        for j in range(1, len(items))
    ]
    out = torch.full((len(rows), MAX_HISTORY + 1), -1, dtype=torch.int64)
    for row, (history, target) in enumerate(rows):
        out[row, : len(history)] = torch.tensor(history)
        out[row, MAX_HISTORY] = target
    return out
