"""Evaluation metrics computed exactly over every rank's samples.

Each metric has its own `update(...)`, plus `reset()` and `compute(strategy)`, the protocol the
Trainer looks for (`Metric`, `is_metric`). `compute` is collective and gives the same dict on
every rank: the global value (sums all-reduced once, or samples gathered), never a mean of
per-rank means. docs/metrics.md shows them in a plain loop.
"""

from manualpar.metrics.auc import AUC, exact_auc
from manualpar.metrics.ctr import CTRMetrics
from manualpar.metrics.log_loss import LogLoss
from manualpar.metrics.protocol import Metric, is_metric
from manualpar.metrics.ranking import RankingMetrics
from manualpar.metrics.ranks import target_ranks_from_scores

__all__ = [
    "AUC",
    "CTRMetrics",
    "LogLoss",
    "Metric",
    "RankingMetrics",
    "exact_auc",
    "is_metric",
    "target_ranks_from_scores",
]
