"""Initial table values that do not depend on how the table is sharded.

Each value is a hash of (seed, table name, row, column): any rank produces any rectangle of any
table by itself, in one pass, and a sharded table holds exactly the values of the unsharded one
for every plan and world size. The hash is splitmix64 (kernels/splitmix.py) over a per-element
counter, the top 24 bits giving a uniform float in [0, 1). The C++ kernel and the torch ops
below produce identical bits; the C++ one is about 10x faster than `uniform_` on CPU.
"""

from __future__ import annotations

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.kernels.splitmix import shift_right, signed, table_key, torch_mix

__all__ = ["init_rows", "init_rows_at", "init_rows_into"]


def _torch_uniform(key: int, counters: torch.Tensor) -> torch.Tensor:
    return shift_right(torch_mix(key, counters), 40).to(torch.float32) * 2.0**-24


@torch.no_grad()
def init_rows(
    config: EmbeddingBagConfig,
    seed: int,
    rows: tuple[int, int],
    columns: tuple[int, int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values of rows [r0, r1) and columns [c0, c1) of the table, on CPU unless `out` is given,
    in `out`'s dtype (default the table's): half rows hold the float32 value rounded to nearest."""
    (r0, r1), (c0, c1) = rows, columns
    if out is None:
        out = torch.empty(r1 - r0, c1 - c0, dtype=config.dtype)
    key, bound, dim = table_key(seed, config.name), config.bound, config.embedding_dim
    if native_kernels_take(out) and out.is_contiguous():
        loaded_kernels().uniform_rows(out, signed(key), r0, c0, dim, bound)
        return out
    for start in range(r0, r1, 4096):  # bounded temporaries on the torch path
        stop = min(start + 4096, r1)
        counters = torch.arange(start, stop, device=out.device).unsqueeze(1) * dim + torch.arange(
            c0, c1, device=out.device
        )
        values = _torch_uniform(key, counters).mul_(2 * bound).sub_(bound)
        out[start - r0 : stop - r0].copy_(values)
    return out


@torch.no_grad()
def init_rows_at(
    config: EmbeddingBagConfig, seed: int, rows: torch.Tensor, columns: tuple[int, int]
) -> torch.Tensor:
    """Values (float32, on CPU) of the scattered table `rows` (int64) and columns [c0, c1): the
    same bits as `init_rows` over any range holding them (the disk tier generates rows on first
    use)."""
    c0, c1 = columns
    key, bound, dim = table_key(seed, config.name), config.bound, config.embedding_dim
    counters = rows.cpu().unsqueeze(1) * dim + torch.arange(c0, c1)
    return _torch_uniform(key, counters).mul_(2 * bound).sub_(bound)


@torch.no_grad()
def init_rows_into(
    config: EmbeddingBagConfig,
    seed: int,
    rows: torch.Tensor,
    columns: tuple[int, int],
    out: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """`init_rows_at` written into rows `slots` of `out` (in its dtype): one C++ pass on CPU."""
    if native_kernels_take(out, slots) and out.is_contiguous():
        key, dim = table_key(seed, config.name), config.embedding_dim
        loaded_kernels().uniform_rows_at(
            out, slots.contiguous(), rows.contiguous(), signed(key), columns[0], dim, config.bound
        )
        return
    values = init_rows_at(config, seed, rows, columns)
    out.index_copy_(0, slots, values.to(out.device, out.dtype))
