"""Trainer(precision=...): autocast around training_step and validation_step, and the gradient
scaler fp16 needs.

"bf16-mixed" has fp32's exponent range and needs no scaler. "fp16-mixed" scales the loss
(torch.amp.GradScaler) so small gradients survive float16, and unscales the dense gradients
before clipping and the optimizer step. Sharded embedding tables are updated by their fused
optimizer inside backward, from the gradient as it arrives: a scaled gradient would reach the
rows scaled, and an overflow skip would not undo a row update. So fp16-mixed is refused for a
model that holds them (bf16-mixed is the mixed precision for those models).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from manualpar.builders import sharded_grad_scaler
from manualpar.dtensors import is_dtensor
from manualpar.embeddings import ShardedEmbeddingBagCollection, ShardedEmbeddingCollection
from manualpar.errors import ConfigError
from manualpar.ownership import trained_by_owner
from manualpar.strategy import ManualParallelStrategy

__all__ = ["PRECISIONS", "Precision"]

PRECISIONS: dict[str, torch.dtype | None] = {
    "32": None,
    "bf16-mixed": torch.bfloat16,
    "fp16-mixed": torch.float16,
}


class Precision:
    def __init__(self, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ConfigError(
                f"Trainer: precision must be one of {tuple(PRECISIONS)}, got {precision!r}"
            )
        self.name, self.dtype = precision, PRECISIONS[precision]
        self.scaler: Any = None  # fp16-mixed's, after setup()

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        """Autocast to this precision's dtype on `device`'s type (nothing for "32")."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=device.type, dtype=self.dtype):
            yield

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: ManualParallelStrategy
    ) -> None:
        """Make fp16-mixed's scaler for this fit."""
        self.scaler = self._grad_scaler(model, optimizer, strategy)

    def entries(self) -> dict[str, Any]:
        """The scaler's checkpoint entry (its scale and growth tracker), if any."""
        return {} if self.scaler is None else {"scaler": self.scaler}

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the dense gradients by the scale (before clipping them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """The optimizer step (fp16: skipped when a gradient overflowed); values to log."""
        if self.scaler is None:
            optimizer.step()
            return {}
        self.scaler.step(optimizer)
        self.scaler.update()
        return {"grad_scale": float(self.scaler.get_scale())}

    def _grad_scaler(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: ManualParallelStrategy
    ) -> Any:
        """The scaler for fp16-mixed (None otherwise); refuses a model with sharded tables.

        Gradients identical on every rank (DDP, a single process) take torch.amp.GradScaler;
        sharded ones (fsdp, tp: DTensors) take the strategy's ShardedGradScaler, so an overflow
        found on one rank's shard skips the step on all."""
        if self.name != "fp16-mixed":
            return None
        tables = [
            name
            for name, module in model.named_modules()
            if isinstance(module, ShardedEmbeddingBagCollection | ShardedEmbeddingCollection)
        ]
        if tables or any(trained_by_owner(p) for p in model.parameters()):
            where = f" ({', '.join(n or type(model).__name__ for n in tables)})" if tables else ""
            raise ConfigError(
                f"Trainer(precision='fp16-mixed'): {type(model).__name__} holds sharded "
                f"embedding tables{where}, which their fused optimizer updates inside backward "
                "from the loss-scaled gradient; use precision='bf16-mixed' (no loss scaling)"
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if strategy.is_distributed and any(is_dtensor(p) for p in params):
            return sharded_grad_scaler(strategy)
        return torch.amp.GradScaler(strategy.device.type)
