"""The optional training loop: Trainer, step-addressed data, rank-prefixed logs, finite checks.

Built only on the public API below it (strategy, builders, checkpoint IO); nothing here is needed
to use the builders in a hand-written loop.
"""

from manualpar.loop.checks import check_finite
from manualpar.loop.data import dataset_batches
from manualpar.loop.logs import log_with_rank
from manualpar.loop.trainer import Trainer

__all__ = ["Trainer", "check_finite", "dataset_batches", "log_with_rank"]
