"""DCN-v2's cross network (Wang et al., 2021): explicit feature crosses of bounded degree.

Each layer multiplies the input x_0 elementwise by an affine map of the previous layer's output
and adds that output back: x_{l+1} = x_0 * (W_l x_l + b_l) + x_l, so layer l models crosses up
to degree l + 2. W_l is a full d x d matrix, or with `rank=r` the product U_l V_l^T of two
d x r matrices ("DCN-Mix"'s low-rank form without the mixture): 2dr parameters instead of d^2.
"""

from __future__ import annotations

import torch
from torch import nn

from manualpar.errors import ConfigError

__all__ = ["CrossNet"]


class CrossNet(nn.Module):
    """`num_layers` cross layers on `in_features`-wide inputs: forward (B, d) -> (B, d).

    Parameters, stacked over layers so the module holds them directly (what meta init and
    `mp.fsdp` need): `weight` (L, d, d) when full-rank, else `u` and `v` (L, d, rank);
    `bias` (L, d). Initialized as DCN-v2's reference code does: weights Xavier-normal per layer,
    biases zero.
    """

    weight: nn.Parameter | None
    u: nn.Parameter | None
    v: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        *,
        rank: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"CrossNet({name}={value!r}): pass a whole number >= 1")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ConfigError(
                f"CrossNet(rank={rank!r}): pass a whole number >= 1, or None for full-rank layers"
            )
        self.in_features, self.num_layers, self.rank = in_features, num_layers, rank

        def new(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        if rank is None:
            self.weight = new(num_layers, in_features, in_features)
            self.u = self.v = None
        else:
            self.weight = None
            self.u, self.v = new(num_layers, in_features, rank), new(num_layers, in_features, rank)
        self.bias = new(num_layers, in_features)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-normal weights (each layer's matrix, or each of U and V), zero biases."""
        for stacked in (self.weight, self.u, self.v):
            if stacked is not None:
                for layer in stacked.data:  # fan-in and fan-out of one layer, not of the stack
                    nn.init.xavier_normal_(layer)
        nn.init.zeros_(self.bias)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        if x0.shape[-1] != self.in_features:
            raise ConfigError(
                f"CrossNet: inputs of width {x0.shape[-1]}, but the layers take "
                f"{self.in_features} features; pass (..., {self.in_features}) inputs"
            )
        x = x0
        for layer in range(self.num_layers):
            x = x0 * (self._linear(layer, x) + self.bias[layer]) + x
        return x

    def _linear(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """W_l x for each row of x: x W^T, or (x V) U^T for the low-rank W = U V^T."""
        if self.weight is not None:
            return x @ self.weight[layer].T
        assert self.u is not None and self.v is not None
        return (x @ self.v[layer]) @ self.u[layer].T

    def extra_repr(self) -> str:
        rank = "full" if self.rank is None else str(self.rank)
        return f"in_features={self.in_features}, num_layers={self.num_layers}, rank={rank}"
