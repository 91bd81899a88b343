"""What a run shows on the terminal: rank-prefixed logging for manualpar's own loggers, and rank
0's progress bar.

With N processes writing to one terminal or log file, a line is only useful if it says which
rank wrote it. `log_with_rank(strategy)` gives the "manualpar" logger a stderr handler whose lines
start with "[rank R/W]": warnings and errors from every rank, informational lines (a resume, a
checkpoint saved) from rank 0 only. It changes nothing if the logger already has a handler, so an
application's own logging setup wins.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["log_with_rank", "progress_bar"]

LOGGER = "manualpar"


class _RankFields(logging.Filter):
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank, record.world_size = self.rank, self.world_size
        return record.levelno >= logging.WARNING or self.rank == 0


def log_with_rank(rank: int, world_size: int, level: int = logging.INFO) -> logging.Logger:
    """Install the rank-prefixed handler on the "manualpar" logger (once); return the logger."""
    logger = logging.getLogger(LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.addFilter(_RankFields(rank, world_size))
        handler.setFormatter(
            logging.Formatter("[rank %(rank)d/%(world_size)d] %(levelname)s %(name)s: %(message)s")
        )
        logger.addHandler(handler)
        logger.setLevel(level)
    return logger


def progress_bar(total: int, initial: int) -> Any:
    """The training progress bar (rank 0 only: the caller decides), from `initial` steps."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
