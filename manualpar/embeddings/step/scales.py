"""The weights a step puts on its numbers: each sender's share of the table gradient, and the
1/length scale of mean-pooled features (the forward applies it, backward scales by it)."""

from __future__ import annotations

import torch

from manualpar.embeddings.step.routing import Routing

__all__ = ["mean_features", "pooling_scale", "sender_scales"]


def sender_scales(
    normalize_by: str, batch_sizes: list[int], job_batch_sizes: list[int] | None = None
) -> list[float]:
    """Weight of each sender's loss in the table gradient: 1 / (ranks of the job), or its
    share of the job's samples. `job_batch_sizes`: every job rank's batch (default: the
    senders are the whole job)."""
    job = batch_sizes if job_batch_sizes is None else job_batch_sizes
    if normalize_by == "world_size":
        return [1 / len(job)] * len(batch_sizes)
    total = sum(job)
    return [b / total if total else 0.0 for b in batch_sizes]


def mean_features(routing: Routing) -> list[int]:
    """The routed features whose tables pool by mean (fixed by the plan)."""
    return [f for f, (_, t) in enumerate(routing.features) if routing.tables[t].pooling == "mean"]


def pooling_scale(
    routing: Routing, means: list[int], lengths: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """(batch, total_dim) factors 1/len for the mean-pooled features `means`, or None."""
    if not means:
        return None
    scale = torch.ones(lengths.shape[1], routing.total_dim, dtype=dtype, device=lengths.device)
    for f in means:
        start = routing.feature_offsets[f]
        inverse = 1 / lengths[f].clamp(min=1).to(dtype).unsqueeze(1)
        scale[:, start : start + routing.dims[f]] = inverse
    return scale
