"""Builders that wrap parts of a model: ddp, fsdp, zero optimizer (one family per file)."""

from manualpar.wrappers.ddp import ddp, set_batch_size
from manualpar.wrappers.fsdp import fsdp
from manualpar.wrappers.zero import sharded_grad_scaler, zero_optimizer

__all__ = ["ddp", "fsdp", "set_batch_size", "sharded_grad_scaler", "zero_optimizer"]
