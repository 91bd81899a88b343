"""Builders that take over parts of a model: ddp, fsdp, tp, zero optimizer (one family per file),
and clip_grad_norm_ over what they produce."""

from manualpar.builders.ddp import ddp, set_batch_size
from manualpar.builders.fsdp import fsdp
from manualpar.builders.grad_norm import clip_grad_norm_, total_grad_norm
from manualpar.builders.tp import tp
from manualpar.builders.zero import sharded_grad_scaler, zero_optimizer

__all__ = [
    "clip_grad_norm_",
    "ddp",
    "fsdp",
    "set_batch_size",
    "sharded_grad_scaler",
    "total_grad_norm",
    "tp",
    "zero_optimizer",
]
