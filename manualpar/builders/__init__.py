"""Builders that take over parts of a model: ddp, fsdp, zero optimizer (one family per file)."""

from manualpar.builders.ddp import ddp, set_batch_size
from manualpar.builders.fsdp import fsdp
from manualpar.builders.zero import sharded_grad_scaler, zero_optimizer

__all__ = ["ddp", "fsdp", "set_batch_size", "sharded_grad_scaler", "zero_optimizer"]
