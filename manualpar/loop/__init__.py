"""The optional training loop: Trainer, step-addressed data, rank-prefixed logs, finite checks,
early stopping and best checkpoints on a validation value, data read ahead.

Built only on the public API below it (strategy, builders, checkpoint IO); nothing here is needed
to use the builders in a hand-written loop.
"""

from manualpar import deprecated
from manualpar.loop.best_checkpoints import BestCheckpoints
from manualpar.loop.checks import check_finite
from manualpar.loop.data import dataset_batches
from manualpar.loop.early_stopping import EarlyStopping
from manualpar.loop.logs import log_with_rank
from manualpar.loop.pipeline import TrainPipeline
from manualpar.loop.predict import Predictions, predict, scoring_batches
from manualpar.loop.read_ahead import ReadAhead
from manualpar.loop.trainer import Trainer

__all__ = [
    "BestCheckpoints",
    "EarlyStopping",
    "Predictions",
    "ReadAhead",
    "TrainPipeline",
    "Trainer",
    "check_finite",
    "dataset_batches",
    "log_with_rank",
    "predict",
    "scoring_batches",
]


def __getattr__(name: str) -> object:
    """A name renamed in 0.3 (deprecated.py): a warning giving its new spelling, then it."""
    return globals()[deprecated.moved(__name__, name)[1]]
