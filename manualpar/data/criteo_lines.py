"""Criteo-format lines parsed a block at a time with numpy, with no Python loop over lines or
fields.

The format (Criteo Kaggle display advertising `train.txt`, Criteo Terabyte `day_0` ...
`day_23`), one sample per line, tab-separated:

    label \\t I1 ... I13 \\t C1 ... C26

label 0 or 1; I1..I13 integers (empty when missing; Kaggle has negative ones); C1..C26 hex
strings of up to 8 digits (empty when missing). The block's tabs and newlines give every field's
start and length, and numbers.decode_numbers decodes every field at once. A malformed line
raises DataFileError naming its file, line and field, or is counted and left out (BadLines).
"""

from __future__ import annotations

import numpy as np

from manualpar.data.bad_lines import BadLines, excerpt
from manualpar.data.criteo_batch import (
    FIELD_NAMES,
    FIELDS,
    MISSING_ID,
    NUM_DENSE,
    NUM_SPARSE,
    Columns,
    log_counts,
)
from manualpar.data.lines import NEWLINE, LinePlace, drop_blank_lines, select_lines
from manualpar.data.numbers import MAX_HEX_DIGITS, MAX_INT_DIGITS, ZERO, decode_numbers

__all__ = ["parse_block"]

TAB, CR, MINUS = 9, 13, ord("-")
_EXPECTED = (  # what a field should be, by kind: label (0), integers (1 to 13), hex (14 to 39)
    "a label (0 or 1)",
    f"an integer (up to {MAX_INT_DIGITS} digits, optional '-') or empty",
    f"a hex string (1 to {MAX_HEX_DIGITS} digits) or empty",
)


def parse_block(
    block: np.ndarray,
    place: LinePlace,
    line_numbers: np.ndarray,
    bad_lines: BadLines | None = None,
) -> Columns:
    """Parse whole lines (uint8, each ending in a newline); blank lines are dropped.
    `line_numbers` are their 1-based numbers among the lines `place` read, for messages. A
    malformed line raises DataFileError naming it, or, if `bad_lines` skips, is counted and
    left out."""
    policy = bad_lines if bad_lines is not None else BadLines()
    block, line_numbers = drop_blank_lines(block, line_numbers)
    policy.lines += len(line_numbers)
    block, line_numbers, separators = _whole_records(block, place, line_numbers, policy)
    if not len(line_numbers):
        return Columns.concat([])
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
            f"{place.line(int(line_numbers[line]))}: field {field + 1} ({FIELD_NAMES[field]}) "
            f"is {excerpt(text)!r}, not {_EXPECTED[min(field, 1) + (field > NUM_DENSE)]}",
        )
        keep = ~rows
        labels, counts, ids = labels[keep], counts[keep], ids[keep]
    policy.check(place.path)
    return Columns(labels, log_counts(counts), ids)


def _whole_records(
    block: np.ndarray, place: LinePlace, line_numbers: np.ndarray, policy: BadLines
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
        f"{place.line(int(line_numbers[bad]))}: expected {FIELDS} tab-separated fields (label, "
        f"{NUM_DENSE} integers, {NUM_SPARSE} hex strings), got {int(tabs[bad]) + 1}",
    )
    block = select_lines(block, ~wrong)
    return block, line_numbers[~wrong], np.flatnonzero((block == NEWLINE) | (block == TAB))
