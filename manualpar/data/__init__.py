"""Data readers: Criteo-format click logs and MovieLens ratings, read from files on disk.

Criteo logs (tab-separated `label, I1..I13, C1..C26`, plain or gzip) are parsed a block at a
time with numpy in constant memory. `CriteoStream` is the Trainer's step-addressed data: batch
`step` is the same lines on every run with the same files and world size, so a resumed run
continues exactly. Each rank reads its share (`rank_share`): whole files when there are at
least as many files as ranks, else a byte range of each plain file (about 1/world of its
bytes); gzip files cannot be split, so with fewer gzip files than ranks every rank decompresses
each one and keeps every world-th line. Malformed lines raise DataFileError naming the file,
line and field, or are skipped and counted up to a share (`BadLines`). docs/data.md has more.
"""

from manualpar.data.bad_lines import BAD_LINE_POLICIES, BadLines
from manualpar.data.byte_ranges import byte_ranges
from manualpar.data.criteo import CriteoStream, read_head, read_share, share_batches
from manualpar.data.criteo_batch import (
    CRITEO_FEATURES,
    MISSING_ID,
    NUM_DENSE,
    NUM_SPARSE,
    Columns,
    CriteoBatch,
    criteo_batch,
    log_counts,
)
from manualpar.data.lines import MAX_LINE_BYTES, READ_BYTES
from manualpar.data.movielens import Ratings, fetch_movielens_100k, read_ratings
from manualpar.data.shares import Part, Share, rank_share

__all__ = [
    "BAD_LINE_POLICIES",
    "CRITEO_FEATURES",
    "MAX_LINE_BYTES",
    "MISSING_ID",
    "NUM_DENSE",
    "NUM_SPARSE",
    "READ_BYTES",
    "BadLines",
    "Columns",
    "CriteoBatch",
    "CriteoStream",
    "Part",
    "Ratings",
    "Share",
    "byte_ranges",
    "criteo_batch",
    "fetch_movielens_100k",
    "log_counts",
    "rank_share",
    "read_head",
    "read_ratings",
    "read_share",
    "share_batches",
]
