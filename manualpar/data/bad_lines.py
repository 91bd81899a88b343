"""What a reader does with lines that are not in its format.

A malformed line raises by default. `BadLines(policy="skip")` counts and skips them, but refuses
once more than `max_share` of the lines read were bad: a file that is mostly bad is not the
format, and skipping it silently would train on almost nothing. Field texts in messages are cut
(`excerpt`), so a huge field never floods a log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from manualpar.errors import DataFileError

__all__ = ["BAD_LINE_POLICIES", "BadLines", "excerpt"]

# what BadLines does with a malformed line: raise naming it, or skip and count it
BAD_LINE_POLICIES = ("raise", "skip")
EXCERPT_CHARS = 80  # of a field's text in an error message
log = logging.getLogger("manualpar.data")


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text`, or its first `limit` characters and its length when longer (for messages)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


@dataclass
class BadLines:
    """What a reader does with a malformed line, and its count so far.

    policy "raise" (the default): raise DataFileError naming its file and line. "skip": leave it
    out, count it, and raise once more than `max_share` of the lines read so far were bad; the
    share is checked after every block from `min_lines` lines on, and at the end of every file.
    """

    policy: str = "raise"
    max_share: float = 0.001
    min_lines: int = 10_000
    lines: int = 0  # lines read (blank ones not counted)
    skipped: int = 0
    first: str | None = None  # the first skipped line's error

    def __post_init__(self) -> None:
        if self.policy not in BAD_LINE_POLICIES:
            raise DataFileError(
                f"bad-lines policy must be one of {BAD_LINE_POLICIES}, got {self.policy!r}"
            )
        if not 0 <= self.max_share < 1:
            raise DataFileError(f"bad-lines max_share must be in [0, 1), got {self.max_share}")

    def bad(self, count: int, message: str) -> None:
        """`count` malformed lines in a block, the first of which `message` describes."""
        if self.policy == "raise":
            raise DataFileError(message)
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
            raise DataFileError(
                f"{path}: {self.skipped} of the {self.lines} lines read so far were malformed "
                f"and skipped ({self.skipped / self.lines:.2%}), more than the allowed "
                f"{self.max_share:.2%}; the first: {self.first}. Fix or filter the files, or "
                "allow a larger share of bad lines"
            )

    def summary(self) -> str:
        """One line for a log: how many lines were skipped of how many read."""
        share = self.skipped / self.lines if self.lines else 0.0
        return f"skipped {self.skipped} malformed lines of {self.lines} read ({share:.3%})"
